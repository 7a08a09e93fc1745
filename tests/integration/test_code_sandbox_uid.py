"""Each sandboxed item runs as a uid of its own: a process of the host's shared ``nobody`` (65534), the user
items ran as before, can neither signal nor ptrace a running item; two items at once never share a uid;
the program is non-dumpable. Real sandbox (namespaces, cgroups, root), real processes."""

import asyncio
import ctypes
import os
import pwd
import shutil
import signal
import time

import pytest

from reward_service.builtin import sandbox
from reward_service.builtin.sandbox_uids import FIRST_UID, UID_COUNT, UidPool, uids_in_use
from reward_service.plugins import REGISTRY, Item

NOBODY = 65534
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="the code sandbox needs root and unshare (util-linux) for its namespaces",
)

PTRACE_ATTACH, PTRACE_DETACH = 16, 17


def _status(pid: int, field: str) -> list[str]:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split()[1:] for line in f if line.startswith(field + ":"))


def _items_running(marker: str) -> dict[int, int]:
    """pid -> uid of the host's processes running the program ``marker`` (not root: the sandbox's launcher
    and unshare also name it, as root)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmd = open(f"/proc/{entry.name}/cmdline", "rb").read().split(b"\0")
            uid = int(_status(int(entry.name), "Uid")[0])
        except (OSError, StopIteration):
            continue
        if uid != 0 and marker.encode() in cmd:
            found[int(entry.name)] = uid
    return found


def _as_nobody_try(pid: int) -> dict[str, int]:
    """From a child process of user nobody: the errno of kill(pid, 0), kill(pid, SIGSTOP) and
    ptrace(PTRACE_ATTACH, pid) (0 = it worked)."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # the attacker: another process of the user items used to run as
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = []
            for sig in (0, signal.SIGSTOP):
                try:
                    os.kill(pid, sig)
                    out.append(0)
                except OSError as e:
                    out.append(e.errno)
            libc = ctypes.CDLL(None, use_errno=True)
            rc = libc.ptrace(PTRACE_ATTACH, pid, None, None)
            out.append(0 if rc == 0 else ctypes.get_errno())
            if rc == 0:
                libc.ptrace(PTRACE_DETACH, pid, None, None)
            os.write(w, ",".join(map(str, out)).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = os.read(r, 100).decode()
    os.close(r)
    os.waitpid(child, 0)
    kill0, stop, ptrace = map(int, data.split(","))
    return {"kill0": kill0, "sigstop": stop, "ptrace": ptrace}


def test_a_process_of_nobody_can_neither_signal_nor_ptrace_a_running_item():
    async def go():
        marker = "item_uid_probe_1.py"
        other = "item_uid_probe_2.py"
        sleeper = "import time\nprint('up', flush=True)\ntime.sleep(30)\n"
        limits = sandbox.Limits(wall_s=25)
        runs = [
            asyncio.create_task(sandbox.run({marker: sleeper}, [marker], b"", limits)),
            asyncio.create_task(sandbox.run({other: sleeper}, [other], b"", limits)),
        ]
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (_items_running(marker) and _items_running(other)):
                await asyncio.sleep(0.1)
            ((pid, uid),) = _items_running(marker).items()
            ((_, uid2),) = _items_running(other).items()
            assert uid != NOBODY and FIRST_UID <= uid < FIRST_UID + UID_COUNT, uid
            assert uid2 != uid  # two items at once: two uids
            with pytest.raises(KeyError):
                pwd.getpwuid(uid)  # no user of the host has it
            assert _status(pid, "Gid")[0] == str(uid)  # nor a group: its gid is its own too
            tried = await asyncio.to_thread(_as_nobody_try, pid)
            assert tried == {"kill0": 1, "sigstop": 1, "ptrace": 1}, tried  # EPERM, EPERM, EPERM
            assert _status(pid, "State")[0] == "S"  # still running, not stopped
        finally:
            for t in runs:
                t.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
        return uid, uid2

    uid, uid2 = asyncio.run(go())
    time.sleep(0.5)
    assert not {uid, uid2} & uids_in_use()  # no process of the runs' uids is left


def test_code_exec_items_are_non_dumpable_and_run_as_the_configured_range(tmp_path):
    code = (
        "def me():\n    import os\n    return os.getuid()\n"
        "def dumpable():\n    import ctypes\n    return ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)\n"
    )  # PR_GET_DUMPABLE
    first = 1_950_000_000

    async def go():
        plug = REGISTRY["code_exec"](
            {"uid_first": first, "uid_count": 16, "isolation": "rlimits", "check_sandbox": False}
        )
        return await plug.score(
            [
                Item(
                    "",
                    code,
                    metadata={
                        "tests": [f"assert me() >= {first}", f"assert me() < {first + 16}", "assert dumpable() == 0"]
                    },
                )
            ]
        )

    (r,) = asyncio.run(go())
    assert r.status == "ok" and r.details["passed"] == 3.0, r


def test_a_leased_uid_is_not_leased_again_until_released(tmp_path):
    pool = UidPool(1_960_000_000, 2, lock_dir=tmp_path / "locks")
    other = UidPool(1_960_000_000, 2, lock_dir=tmp_path / "locks")  # another plugin, or another service
    a, b = pool.acquire(), other.acquire()
    assert {a.uid, b.uid} == {1_960_000_000, 1_960_000_001}
    with pytest.raises(RuntimeError, match="no free uid"):
        pool.acquire()
    a.release()
    assert other.acquire().uid == a.uid
