"""An SGLang server started by the ``sglang`` backend itself (``generator.backend.launch.python`` set): one
``python -m sglang.launch_server`` per generator, on a free loopback port, from the first weight version's
folder, stopped with the generator. SGLang lives in its own environment (its pinned torch), so the server
runs under that environment's interpreter, never this process's (docs/generators.md, "SGLang on CPU").

The server always requires a key (SGLang's ``--api-key``: every route but ``/health*`` and ``/metrics``
answers 401 without ``Authorization: Bearer <key>``): ``generator.backend.api_key`` if set, else a fresh
random one per launch. The key reaches the server in a 0600 config file (``--config``), never on its command
line (readable by every local user in /proc), and never in a log line: the server's output is forwarded with
the key replaced by ``***`` (docs/security.md, "The launched SGLang server").

Ports: the port is picked free, then bound by the server tens of seconds later (after the model loads), so
another process may take it in between. A server whose output says its port is taken is stopped and started
again on a freshly picked port, up to ``tries`` ports in all. "Ready" means that the port's listening socket
is the server process's own (/proc/net/tcp) and that it answers the readiness route with the key: a process
that took the port is never mistaken for the server, and is never sent a request.

The server is a child in its own process group with PR_SET_PDEATHSIG (it dies with the generator even if the
generator is killed with SIGKILL); ``stop`` ends the whole group by its id (SGLang's scheduler and
detokenizer are children of the server process).
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import httpx

from broker.runtime.ports import free_port

log = logging.getLogger("relay.generator.sglang")

PR_SET_PDEATHSIG = 1
PORT_TRIES = 3  # ports tried in all before giving up
LOG_TAIL = 30  # the server's last output lines kept for an error message
# uvicorn's "[Errno 98] ... address already in use"; SGLang's "Port is already in use" (its own ports); torch's
# TCPStore "EADDRINUSE"
_PORT_TAKEN = re.compile(r"(address|port) (is )?already in use|errno 98\b|eaddrinuse", re.IGNORECASE)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: stop() still ends the group
        pass


def new_key() -> str:
    """A fresh key for one launch (256 bits), not starting with "-" (an argument parser would take it for an
    option)."""
    while (key := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return key


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on 127.0.0.1:``port`` (Linux: /proc/net/tcp's
    inode among the process's descriptors). Elsewhere: True (no way to tell; the key still guards)."""
    try:
        rows = open("/proc/net/tcp").read().splitlines()[1:]
    except OSError:
        return True
    want = f"0100007F:{port:04X}"
    inodes = {f"socket:[{f[9]}]" for f in (r.split() for r in rows) if f[1] == want and f[3] == "0A"}
    if not inodes:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # the process is gone
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:  # closed meanwhile
            continue
    return False


class _Output:
    """A child's stdout and stderr, forwarded line by line to this process's stderr (the key replaced by
    ``***``; relay up writes it to the generator's log file), the last ``LOG_TAIL`` lines kept."""

    def __init__(self, stream, secret: str):
        self.stream, self.secret = stream, secret
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL)
        self.port_taken = ""  # the line that said the port was taken
        self.redacted = 0  # lines in which the key was replaced (SGLang prints its arguments at start)
        self.thread = threading.Thread(target=self._pump, name="sglang-output", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        for raw in iter(self.stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            if self.secret in line:
                line = line.replace(self.secret, "***")
                self.redacted += 1
            self.tail.append(line.rstrip("\n"))
            if not self.port_taken and _PORT_TAKEN.search(line):
                self.port_taken = line.strip()
            try:
                sys.stderr.write(line)
            except (OSError, ValueError):  # this process's stderr is closed (exiting): keep draining the pipe, or
                continue  # the server would block on its next log line once the pipe is full
        self.stream.close()

    def last(self, n: int = LOG_TAIL) -> str:
        return "\n".join(list(self.tail)[-n:]) or "(no output)"


class PortTaken(RuntimeError):
    pass


class LaunchedServer:
    """A loopback HTTP server run as a child: ``argv_for(port)`` started on a free port, ready once it holds
    the port and answers ``ready_path`` with ``Authorization: Bearer <api_key>``; started again on a new port
    when its output says the port is taken (``tries`` ports in all)."""

    def __init__(
        self,
        argv_for: Callable[[int], list[str]],
        env: dict[str, str],
        api_key: str,
        start_timeout_s: float,
        ready_path: str = "/model_info",
        pick_port: Callable[[], int] = free_port,
        tries: int = PORT_TRIES,
        name: str = "SGLang",
    ):
        if not api_key:
            raise ValueError("a launched server always requires a key")
        self.api_key, self.name, self.ready_path = api_key, name, ready_path
        self.ports: list[int] = []
        self.taken: dict[int, str] = {}  # port -> the server's line saying it was taken
        for attempt in range(tries):
            self.port = pick_port()
            self.ports.append(self.port)
            self.url = f"http://127.0.0.1:{self.port}"
            argv = argv_for(self.port)
            if attempt == 0:
                log.info("starting %s: %s", name, " ".join(argv))
            else:
                log.warning(
                    "%s: port %d was taken before the server bound it; starting again on port %d",
                    name,
                    self.ports[-2],
                    self.port,
                )
            # stdout/stderr: piped through _Output to the generator's own stderr
            self.proc = subprocess.Popen(
                argv,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            self.output = _Output(self.proc.stdout, api_key)
            try:
                self._wait_ready(start_timeout_s)
                return
            except PortTaken:
                self.taken[self.port] = self.output.port_taken
                self.stop()
        raise RuntimeError(
            f"the {name} server could not bind a port: each of {self.ports} was taken before it bound it "
            f"({tries} tries); its last output:\n{self.output.last()}"
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _ready(self) -> bool:
        if not listens(self.pid, self.port):  # not bound yet, or bound by another process: send it nothing
            return False
        headers = {"Authorization": f"Bearer {self.api_key}"}
        try:
            return httpx.get(f"{self.url}{self.ready_path}", headers=headers, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _wait_ready(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.output.port_taken:
                raise PortTaken(self.port)
            if self.proc.poll() is not None:
                self.output.thread.join(5.0)  # its last lines (the reason it exited)
                if self.output.port_taken:
                    raise PortTaken(self.port)
                raise RuntimeError(
                    f"the {self.name} server exited with code {self.proc.returncode} while starting on port "
                    f"{self.port}; its last output:\n{self.output.last()}"
                )
            if self._ready():
                log.info("%s server ready in %.1fs (pid %d, %s)", self.name, time.monotonic() - t0, self.pid, self.url)
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"the {self.name} server did not answer {self.ready_path} on port {self.port} within {timeout_s:.0f}s; "
            f"its last output:\n{self.output.last()}"
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after ``grace_s``."""
        if self.proc.poll() is None:
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


def launch_sglang(
    python: str,
    model: str,
    args: list[str],
    env: dict[str, str],
    start_timeout_s: float,
    api_key: str,
    pick_port: Callable[[], int] = free_port,
) -> LaunchedServer:
    """``python -m sglang.launch_server --model-path MODEL`` on a free loopback port, with ``args`` and
    ``env`` added, requiring ``api_key``: given in a 0600 YAML file for ``--config`` (SGLang 0.5.23 merges it
    into its arguments at start, sglang/srt/utils/server_args_config_parser.py), removed once the server
    is ready or has failed."""
    if any(a in ("--api-key", "--config") or a.startswith(("--api-key=", "--config=")) for a in args):
        raise ValueError(
            "generator.backend.launch.args may not set --api-key or --config: a launched SGLang server's key is "
            "generator.backend.api_key (or a fresh one per launch)"
        )
    if not api_key or api_key.startswith("-") or not api_key.isprintable() or " " in api_key:
        raise ValueError("generator.backend.api_key must be printable, without spaces, and not start with '-'")
    child_env = {**os.environ, **env}
    child_env.pop("PYTHONPATH", None)  # Relay's own modules (and its torch) stay out of SGLang's interpreter
    fd, config = tempfile.mkstemp(prefix="relay-sglang-", suffix=".yaml")  # mode 0600, this user's
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"api-key: {json.dumps(api_key)}\n")  # a JSON string is a YAML string

        def argv_for(port: int) -> list[str]:
            argv = [python, "-m", "sglang.launch_server", "--config", config, "--model-path", model]
            return argv + ["--host", "127.0.0.1", "--port", str(port), *args]

        return LaunchedServer(argv_for, child_env, api_key, start_timeout_s, pick_port=pick_port)
    finally:
        os.unlink(config)
