"""One cgroup per sandboxed item: its memory and process limits hold for the whole process tree.

rlimits are per process (``RLIMIT_AS``: every forked child gets the whole budget again) or per host
user (``RLIMIT_NPROC``: one item's fork bomb uses up the count of every item running as the same
user). A cgroup per item counts everything the item's processes do together: ``memory.max`` (the
kernel OOM-kills inside the item when it is reached) and ``pids.max`` (``fork`` fails inside the item,
other items are untouched).

Both hierarchies are supported, found from ``/proc/self/cgroup``:

- **v2** (one ``cgroup2`` mount, e.g. ``/sys/fs/cgroup``): item cgroups are made under the service's
  own cgroup, whose ``cgroup.subtree_control`` must enable ``memory`` and ``pids``. A cgroup with
  processes in it cannot enable them (the kernel's no-internal-processes rule), so its processes are
  first moved into a leaf ``<own>/service`` (what a container that runs its own cgroups does). That
  is done only where the cgroup is the service's own: the root of a private cgroup namespace (a
  container, see docs/deploy.md) or the ``parent`` the operator named (e.g. a systemd unit's
  cgroup with ``Delegate=yes``); a host's cgroups are never reorganised.
- **v1** (separate ``memory`` and ``pids`` mounts): item cgroups are made under the service's own
  cgroup in each.

``parent`` (the plugin's ``cgroup_parent`` option) names another directory to make item cgroups
under (v2: a path of the cgroup2 file system; v1: a path relative to each controller's mount).
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

MOUNTS = Path("/sys/fs/cgroup")


class CgroupError(RuntimeError):
    """Item cgroups cannot be made here (the reason says what is missing)."""


def _own_paths() -> dict[str, str]:
    """{controller or "" for v2: path of this process's cgroup} from /proc/self/cgroup."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            out[c] = path
    return out


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise CgroupError(f"cannot write {value.strip()!r} to {path}: {e.strerror}") from e


@dataclass
class ItemCgroup:
    """The cgroup(s) of one item: the launcher writes its own pid into ``procs``."""

    dirs: list[Path]
    procs: list[str]  # cgroup.procs files to join
    peak_file: Path | None  # the item's peak memory, bytes
    events_file: Path | None

    def peak_mb(self) -> float | None:
        try:
            return round(int(self.peak_file.read_text()) / 2**20, 1) if self.peak_file else None
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes of the item killed by the kernel for memory (0 when the kernel does not say)."""
        if self.events_file is None:
            return 0
        try:
            text = self.events_file.read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, val = line.partition(" ")
            if key == "oom_kill":
                return int(val)
        return 0

    def kill(self) -> None:
        """SIGKILL everything left in the item (the PID namespace usually took them already)."""
        for d in self.dirs:
            if (d / "cgroup.kill").exists():
                try:
                    (d / "cgroup.kill").write_text("1")
                    continue
                except OSError:
                    pass  # an older kernel: kill them one by one below
            try:
                pids = (d / "cgroup.procs").read_text().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass

    def remove(self, wait_s: float = 5.0) -> None:
        """rmdir the item's cgroups once their processes are gone (they die asynchronously)."""
        deadline = time.monotonic() + wait_s
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        raise CgroupError(f"cannot remove {d}: {e.strerror}") from e
                    self.kill()
                    time.sleep(0.02)


class Cgroups:
    """Makes item cgroups; :meth:`check` raises CgroupError where that is not possible."""

    def __init__(self, parent: str | None = None):
        self.parent = parent
        self.version, self.bases = self._find()
        self._enabled = False

    def _find(self) -> tuple[int, dict[str, Path]]:
        own = _own_paths()
        v2_mount = MOUNTS if (MOUNTS / "cgroup.controllers").exists() else MOUNTS / "unified"
        if "" in own and (v2_mount / "cgroup.controllers").exists():
            base = Path(self.parent) if self.parent else v2_mount / own[""].lstrip("/")
            ctrls = (v2_mount / "cgroup.controllers").read_text().split()
            if {"memory", "pids"} <= set(ctrls):
                return 2, {"": base}
        if "memory" in own and "pids" in own and (MOUNTS / "memory").is_dir() and (MOUNTS / "pids").is_dir():
            return 1, {c: MOUNTS / c / (self.parent or own[c]).lstrip("/") for c in ("memory", "pids")}
        raise CgroupError(
            "no cgroup hierarchy with the memory and pids controllers is mounted at "
            f"{MOUNTS} (cgroup v2 with both enabled, or v1 memory and pids)"
        )

    def _enable_v2(self) -> None:
        """Let the base's children have memory.max and pids.max (moving our processes to a leaf)."""
        base = self.bases[""]
        if {"memory", "pids"} <= set((base / "cgroup.subtree_control").read_text().split()):
            self._enabled = True
            return
        if not {"memory", "pids"} <= set((base / "cgroup.controllers").read_text().split()):
            raise CgroupError(
                f"{base} does not have the memory and pids controllers (the parent cgroup must delegate them)"
            )
        procs = (base / "cgroup.procs").read_text().split()
        if procs and not self.parent and _own_paths()[""] != "/":
            raise CgroupError(
                f"{base} has processes and is not the root of a private cgroup namespace: "
                "code_exec reorganises only a cgroup of its own (a container's, or cgroup_parent)"
            )
        if procs:
            leaf = base / "service"
            leaf.mkdir(exist_ok=True)
            for pid in procs:
                try:
                    (leaf / "cgroup.procs").write_text(pid)
                except ProcessLookupError:
                    pass
                except OSError as e:
                    raise CgroupError(f"cannot move process {pid} out of {base}: {e.strerror}") from e
        _write(base / "cgroup.subtree_control", "+memory +pids")
        self._enabled = True

    def make(self, memory_mb: int, max_procs: int) -> ItemCgroup:
        name = "relay-item-" + secrets.token_hex(6)
        mem = str(memory_mb * 2**20)
        try:
            if self.version == 2:
                if not self._enabled:
                    self._enable_v2()
                d = self.bases[""] / name
                d.mkdir()
                cg = ItemCgroup(
                    [d],
                    [str(d / "cgroup.procs")],
                    d / "memory.peak" if (d / "memory.peak").exists() else None,
                    d / "memory.events",
                )
                writes = [(d / "memory.max", mem), (d / "pids.max", str(max_procs))]
                if (d / "memory.swap.max").exists():
                    writes.append((d / "memory.swap.max", "0"))
            else:
                m, p = self.bases["memory"] / name, self.bases["pids"] / name
                cg = ItemCgroup(
                    [m, p],
                    [str(m / "cgroup.procs"), str(p / "cgroup.procs")],
                    m / "memory.max_usage_in_bytes",
                    m / "memory.oom_control",
                )
                m.mkdir()
                try:
                    p.mkdir()
                except OSError:
                    m.rmdir()
                    raise
                writes = [(m / "memory.limit_in_bytes", mem), (p / "pids.max", str(max_procs))]
                if (m / "memory.memsw.limit_in_bytes").exists():  # after the memory limit: it must stay >= it
                    writes.append((m / "memory.memsw.limit_in_bytes", mem))
        except OSError as e:
            raise CgroupError(
                f"cannot make an item cgroup under {', '.join(map(str, self.bases.values()))}: {e.strerror}"
            ) from e
        try:
            for path, value in writes:
                _write(path, value)
        except CgroupError:
            cg.remove()
            raise
        return cg

    def check(self) -> None:
        """Make and remove one item cgroup: CgroupError unless it works."""
        self.make(64, 4).remove()
