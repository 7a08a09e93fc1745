"""An SGLang server started by the ``sglang`` backend itself (``generator.backend.launch.python`` set): one
``python -m sglang.launch_server`` per generator, on a free loopback port, from the first weight version's
folder, stopped with the generator. SGLang lives in its own environment (its pinned torch), so the server
runs under that environment's interpreter, never this process's (docs/generators.md, "SGLang on CPU").

The server is a child in its own process group with PR_SET_PDEATHSIG (it dies with the generator even if the
generator is killed with SIGKILL); ``stop`` ends the whole group by its id (SGLang's scheduler and
detokenizer are children of the server process).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

import httpx

from broker.runtime.ports import free_port

log = logging.getLogger("relay.generator.sglang")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: stop() still ends the group
        pass


class LaunchedServer:
    """``python -m sglang.launch_server --model-path MODEL`` under ``python``, with ``args`` and ``env`` added."""

    def __init__(self, python: str, model: str, args: list[str], env: dict[str, str], start_timeout_s: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [python, "-m", "sglang.launch_server", "--model-path", model]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        child_env = {**os.environ, **env}
        child_env.pop("PYTHONPATH", None)  # Relay's own modules (and its torch) stay out of SGLang's interpreter
        log.info("starting SGLang: %s", " ".join(argv))
        # stdout/stderr: the generator's own (relay up writes them to the generator's log file)
        self.proc = subprocess.Popen(
            argv, env=child_env, start_new_session=True, preexec_fn=_die_with_parent, stdout=sys.stderr
        )
        self._wait_ready(start_timeout_s)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the SGLang server exited with code {self.proc.returncode} while starting")
            try:
                if httpx.get(f"{self.url}/get_model_info", timeout=2.0).status_code == 200:
                    log.info("SGLang server ready in %.1fs (pid %d, %s)", time.monotonic() - t0, self.pid, self.url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"the SGLang server did not answer /get_model_info within {timeout_s:.0f}s")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after ``grace_s``."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group is the server's own (start_new_session)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        except ProcessLookupError:
            pass
        # the scheduler/detokenizer may outlive the server process in its group: end them too
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
