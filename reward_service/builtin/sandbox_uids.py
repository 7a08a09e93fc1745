"""A user id of its own for each sandboxed program, so that no other process of the host shares it.

The sandbox used to run every program as ``nobody`` (65534), a user other services of the host run as
too: any process of ``nobody`` could ptrace a running item (rewrite its program, read its memory) or
signal it (stop it, kill it), since the kernel lets a user do both to its own processes. Now each item
runs as a uid (and gid) that nothing else on the host uses while it runs:

- taken from a range reserved for it, ``first`` .. ``first + count - 1`` (default 1,900,000,000 and 65,536:
  above the ranges distributions, container runtimes and ``/etc/subuid`` hand out, below the range
  systemd keeps for "foreign" images at 2,147,352,576, and below 2^31 where some programs misread uids);
- one with no entry in the user and group databases (``getpwuid``/``getgrgid``) and no process running as
  it (every process's real, effective, saved and file-system uid in ``/proc/*/status``);
- held, for as long as the item runs, by an exclusive ``flock`` on ``LOCK_DIR/<uid>``, so that two items,
  two plugins or two reward services on one host never get the same one.

Only root (the reward service, which sets up the sandbox) can then trace or signal the item. The
program also makes itself non-dumpable when it starts (``_code_runner.py``): no core file, and its memory
stays unreadable even to a process that somehow shared its uid. Where a uid is free again (the item and
every process it left behind are gone, the PID namespace and the cgroup saw to that), the next item may
reuse it: the lowest free one is taken, so the lock files stay as few as the items run at once.
"""

from __future__ import annotations

import fcntl
import grp
import os
import pwd
import threading
from dataclasses import dataclass
from pathlib import Path

FIRST_UID, UID_COUNT = 1_900_000_000, 65536
LOCK_DIR = Path("/run/relay-sandbox-uids")


class NoFreeUid(RuntimeError):
    """Every uid of the range is in use (by items, or by someone else)."""


@dataclass
class UidLease:
    uid: int
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops its flock
            self.fd = -1


def uids_in_use() -> set[int]:
    """Every uid any process of the host runs as (real, effective, saved, file system)."""
    used: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        used.update(int(x) for x in line.split()[1:])
                        break
        except OSError:  # the process exited meanwhile
            continue
    return used


def _unassigned(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return False
    except KeyError:
        pass
    try:
        grp.getgrgid(uid)
        return False
    except KeyError:
        return True


class UidPool:
    """Leases uids of ``first`` .. ``first + count - 1`` (module docstring). Thread-safe."""

    def __init__(self, first: int = FIRST_UID, count: int = UID_COUNT, lock_dir: Path = LOCK_DIR):
        self.first, self.count, self.lock_dir = first, count, lock_dir
        self._lock = threading.Lock()

    def acquire(self) -> UidLease:
        """The lowest uid of the range that is unassigned, unused and not leased by anyone; NoFreeUid when
        there is none, OSError when the lock folder cannot be made (the sandbox needs root)."""
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._lock:
            used = uids_in_use()
            for uid in range(self.first, self.first + self.count):
                if uid in used:
                    continue
                fd = os.open(self.lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # leased by another item (of this process or another)
                    os.close(fd)
                    continue
                if _unassigned(uid):
                    return UidLease(uid, fd)
                os.close(fd)
        raise NoFreeUid(
            f"no free uid in {self.first}..{self.first + self.count - 1} (all leased or used by "
            f"processes of the host); raise uid_count or choose another uid_first"
        )


DEFAULT_POOL = UidPool()
