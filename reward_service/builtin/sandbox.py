"""Run untrusted Python in a sandbox: no network, no host files, time and memory limits.

The isolation is Linux namespaces (``unshare`` from util-linux, which needs root or
CAP_SYS_ADMIN), a minimal chroot, an unprivileged user of its own (a uid no other process of the host
shares, leased per run: ``sandbox_uids.py``), rlimits and, given a
:class:`~reward_service.builtin.cgroups.Cgroups`, one cgroup per run whose memory and process
limits hold for the whole process tree; see ``_sandbox_init.py`` for exactly what the program can
see. :func:`probe` checks at start-up that it works on this machine: where it does not, the
``code_exec`` plugin refuses to start rather than run code unconfined.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from reward_service.builtin.cgroups import Cgroups, CgroupError
from reward_service.builtin.sandbox_uids import DEFAULT_POOL, NoFreeUid, UidPool

LAUNCHER = Path(__file__).with_name("_sandbox_init.py")


@dataclass
class Limits:
    wall_s: float = 5.0  # killed after this long, whatever it does
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS of each process, and memory.max of the run's cgroup (all together)
    disk_mb: int = 32  # size of the tmpfs root and RLIMIT_FSIZE
    max_procs: int = 32  # pids.max of the run's cgroup; without one, RLIMIT_NPROC (per host user)
    max_output: int = 65536  # bytes of stdout/stderr kept


@dataclass
class Outcome:
    returncode: int | None  # None when killed at the wall-clock limit
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    memory_peak_mb: float | None = None  # the run's cgroup's peak (all its processes together)
    oom_kills: int = 0  # processes the kernel killed at the cgroup's memory limit


class SandboxError(RuntimeError):
    """The sandbox itself could not run (not the program's fault)."""


def python_executable() -> str:
    """The base interpreter (not a virtualenv's shim: the sandbox sees no virtualenv)."""
    exe = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    return str(exe) if exe.exists() else os.path.realpath(sys.executable)


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    buf = bytearray()
    while chunk := await stream.read(65536):
        if len(buf) < cap:
            buf += chunk[: cap - len(buf)]
    return bytes(buf)


async def run(
    files: dict[str, str],
    argv: list[str],
    stdin: bytes,
    limits: Limits,
    cgroups: Cgroups | None = None,
    uids: UidPool | None = None,
) -> Outcome:
    """Run ``argv`` (paths relative to /sandbox, where ``files`` are written) in the sandbox.

    With ``cgroups``, the run gets its own cgroup (memory ``limits.memory_mb`` and ``limits.max_procs``
    processes in all); without, only per-process rlimits hold. The program runs as a uid of ``uids``
    (default: the range of ``sandbox_uids``) that no other process of the host has, leased until every
    process of the run is gone.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxError("the `unshare` command (util-linux) is not installed")
    py = python_executable()
    try:
        lease = await asyncio.to_thread((uids or DEFAULT_POOL).acquire)
    except (NoFreeUid, OSError) as e:
        raise SandboxError(f"no user id for the sandbox: {e}") from e
    try:
        try:
            cg = cgroups.make(limits.memory_mb, limits.max_procs) if cgroups else None
        except CgroupError as e:
            raise SandboxError(str(e)) from e
        try:
            outcome = await _run(unshare, py, files, argv, stdin, limits, cg, lease.uid)
        finally:
            if cg is not None:
                cg.kill()
                try:
                    await asyncio.to_thread(cg.remove)
                except CgroupError as e:
                    raise SandboxError(str(e)) from e
    finally:
        lease.release()  # the PID namespace (and the cgroup) took every process of the run with it
    return outcome


async def _run(unshare, py, files, argv, stdin, limits, cg, uid: int) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="relay-sandbox-") as tmp:
        src, root = Path(tmp, "src"), Path(tmp, "root")
        src.mkdir()
        root.mkdir()
        for name, text in files.items():
            (src / name).write_text(text)
        spec = {
            "root": str(root),
            "src": str(src),
            "ro_paths": [sys.base_prefix],
            "argv": [py, "-I", "-S", "-B", *argv],
            "cpu_s": limits.cpu_s,
            "memory_mb": limits.memory_mb,
            "disk_mb": limits.disk_mb,
            "max_procs": None if cg else limits.max_procs,
            "cgroup_procs": cg.procs if cg else [],
            "uid": uid,
        }
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            unshare,
            "--net",
            "--mount",
            "--pid",
            "--ipc",
            "--uts",
            "--fork",
            "--kill-child",
            "--",
            py,
            "-I",
            "-S",
            "-B",
            str(LAUNCHER),
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
        )

        async def talk():
            proc.stdin.write(stdin)
            try:
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the program exited without reading its input; its exit status tells the rest
            out, err = await asyncio.gather(
                _read_capped(proc.stdout, limits.max_output), _read_capped(proc.stderr, limits.max_output)
            )
            await proc.wait()
            return out, err

        task = asyncio.ensure_future(talk())
        try:
            out, err = await asyncio.wait_for(asyncio.shield(task), limits.wall_s)
            timed_out = False
        except asyncio.TimeoutError:
            timed_out = True
            _kill(proc)
            out, err = await task
        except asyncio.CancelledError:  # the request was abandoned: the program goes too, before its uid is
            _kill(proc)  # leased again
            await asyncio.shield(proc.wait())
            raise
        seconds = time.monotonic() - t0
    if proc.returncode == 125 and b"sandbox setup failed" in err:
        raise SandboxError(err.decode(errors="replace").strip()[-300:])
    return Outcome(
        None if timed_out else proc.returncode,
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        timed_out,
        seconds,
        cg.peak_mb() if cg else None,
        cg.oom_kills() if cg else 0,
    )


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # unshare dies, its child (PID 1 inside) and all below with it
    except ProcessLookupError:
        pass


async def probe(cgroups: Cgroups | None = None, uids: UidPool | None = None) -> None:
    """Raise SandboxError unless a program runs in the sandbox (in a cgroup of ``cgroups`` when
    given) and cannot see the network."""
    code = (
        "import socket\n"
        "try:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\nexcept OSError as e:\n    print('isolated', e.errno)\n"
    )
    try:
        o = await run({"p.py": code}, ["p.py"], b"", Limits(wall_s=10), cgroups, uids)
    except OSError as e:
        raise SandboxError(f"cannot start the sandbox: {e}") from e
    if o.returncode != 0 or "isolated" not in o.stdout:
        raise SandboxError(
            f"the sandbox does not work on this machine (needs root or CAP_SYS_ADMIN for "
            f"namespaces): exit {o.returncode}, stderr {o.stderr.strip()[-300:]!r}"
        )
