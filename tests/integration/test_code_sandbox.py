"""code_exec runs the completion against unit tests in a real sandbox: an infinite loop is killed at
its time limit, a network connection is refused, files outside the sandbox cannot be read; programs
written to game the grader (reading the runner's stack, patching builtins, reading the test files)
score 0; an item's forked processes share one memory and process limit (its cgroup)."""

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from reward_service.builtin import sandbox
from reward_service.plugins import REGISTRY, Item
from tests.support.services import ROOT


def _no_cgroups() -> str:
    """Why no item cgroup can be made here ('' when one can)."""
    from reward_service.builtin.cgroups import Cgroups, CgroupError

    try:
        Cgroups().check()
    except (CgroupError, OSError) as e:
        return str(e)
    return ""


NO_CGROUPS = _no_cgroups() if os.geteuid() == 0 else ""
pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None,
        reason="the code sandbox needs root and unshare (util-linux) for its namespaces",
    ),
    pytest.mark.skipif(bool(NO_CGROUPS), reason=f"the code sandbox needs a cgroup per item: {NO_CGROUPS}"),
]


def score(items, **options):
    async def go():
        plug = REGISTRY["code_exec"](options)
        await plug.start()  # the start-up probe: refuses to run unless the sandbox works here
        return await plug.score(items)

    return asyncio.run(go())


def test_solutions_are_scored_by_the_tests_they_pass():
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    half = "def add(a, b):\n    return a + b if a else 0"
    early_exit = "import os\nos._exit(0)"
    tests = ["assert add(1, 2) == 3", "assert add(0, 5) == 5"]
    out = score(
        [
            Item("", good, metadata={"tests": tests}),
            Item("", half, metadata={"tests": tests}),
            Item("", good, reference="assert add(2, 2) == 4"),
            Item("", early_exit, metadata={"tests": tests}),
            Item("", good),
        ]
    )
    assert [r.score for r in out[:4]] == [1.0, 0.5, 1.0, 0.0]
    assert out[3].details["completed"] == 0.0  # exiting early does not pass
    assert out[4].status == "failed" and out[4].reason.startswith("no_tests")


def test_an_infinite_loop_is_killed_at_the_time_limit():
    t0 = time.monotonic()
    (r,) = score([Item("", "def f():\n    while True:\n        pass", reference="assert f() is None")], timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert r.status == "ok" and r.score == 0.0 and r.details["timeout"] == 1.0
    assert 0.9 <= r.details["seconds"] < 3.0 and elapsed < 10  # killed at ~1 s (margin for a loaded machine)


PROBE = """
import socket
def probe(port, host="127.0.0.1"):
    try:
        socket.create_connection((host, port), timeout=2).close()
        return "connected"
    except OSError as e:
        return "blocked: " + str(e)
"""


def test_a_network_connection_is_refused():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        # control: outside the sandbox the same code reaches the listener
        outside = subprocess.run(
            [sys.executable, "-c", PROBE + f"\nprint(probe({port}))"], capture_output=True, text=True, timeout=30
        )
        assert outside.stdout.strip() == "connected"
        listener.accept()[0].close()
        tests = [
            f"assert probe({port}).startswith('blocked'), probe({port})",
            "assert probe(53, '1.1.1.1').startswith('blocked')",
        ]
        (r,) = score([Item("", PROBE, metadata={"tests": tests})])
        assert r.score == 1.0 and r.details["passed"] == 2.0, r  # the host's listener and the outside world
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing from the sandbox arrived


def test_files_outside_the_sandbox_cannot_be_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    targets = [str(secret), str(ROOT / "pyproject.toml"), "/etc/passwd", "/root/.bashrc"]
    assert all(open(t).read() for t in targets[:3])  # control: they exist and are readable here
    code = "def read(p):\n    try:\n        return open(p).read()\n    except OSError as e:\n        return 'denied: ' + type(e).__name__"
    tests = [f"assert read({t!r}).startswith('denied'), read({t!r})[:40]" for t in targets]
    tests.append(
        "open('/sandbox/mine.txt', 'w').write('x'); assert open('mine.txt').read() == 'x'"
    )  # its own dir works
    (r,) = score([Item("", code, metadata={"tests": tests})])
    assert r.details["passed"] == r.details["total"] == len(tests), r


def test_the_probe_fails_clearly_when_namespaces_are_unavailable(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(sandbox.SandboxError, match="unshare"):
        asyncio.run(sandbox.probe())


# --- attackers: the policy's own code trying to pass tests it cannot solve -------------------------
# Every exploit below passed against the previous design (tests and a nonce inside the sandbox, the
# verdict printed by the program's own interpreter). The expected values are unguessable on purpose.
SECRET_TESTS = ["assert solve(3) == 918273645", "assert solve(4) == 'zebra-4471'"]
HONEST = "def solve(x):\n    return 918273645 if x == 3 else 'zebra-4471'"

STACK_READER = r"""
import gc, json, os, sys
# everything the runner holds: its frames' locals (the nonce, the output stream) and all live objects
frames, f = [], sys._getframe()
while f is not None:
    frames.append(f)
    f = f.f_back
seen = [v for fr in frames for v in fr.f_locals.values()] + gc.get_objects()
strings = [s for s in seen if isinstance(s, str)]
for s in strings:  # the old runner's nonce: print its success line
    if len(s) == 32 and all(c in "0123456789abcdef" for c in s):
        print(f"\n{s} 2 2", flush=True)
streams = [v for v in seen if hasattr(v, "write") and hasattr(v, "fileno")]
for i in range(2):  # forge result records on every stream it can find, and on fd 1
    rec = json.dumps({"test": i, "step": 0, "value": True}) + "\n" + json.dumps({"done": True}) + "\n"
    for out in streams:
        try:
            out.write(rec)
            out.flush()
        except (OSError, ValueError):
            pass
    os.write(1, rec.encode())
found = [s for s in strings if "918273645" in s or "zebra" in s]  # an expected value anywhere in memory?
def solve(x):
    return found[0] if found else None
"""

PATCHER = r"""
import builtins, json
class Yes:
    def __eq__(self, other): return True
    def __bool__(self): return True
    __hash__ = object.__hash__
builtins.compile = lambda *a, **k: "x"
builtins.exec = lambda *a, **k: None
builtins.eval = lambda *a, **k: Yes()
builtins.bool = lambda *a: True
builtins.AssertionError = type("AssertionError", (Exception,), {})
json.dumps = lambda rec, *a, **k: '{"test": %d, "step": 0, "value": true}' % rec.get("test", 0)
def solve(x):
    return Yes()
"""

FILE_READER = r"""
import os, re
texts = []
for d in (".", "/sandbox", "/tmp", "/"):
    for name in os.listdir(d):
        p = os.path.join(d, name)
        if os.path.isfile(p):
            try:
                texts.append(open(p, errors="replace").read(1 << 20))
            except OSError:
                pass
answers = {}
for t in texts:  # the old tests.json held the whole asserts
    for arg, want in re.findall(r"solve\((\d+)\) == ([^\"\]\\]+)", t):
        answers[int(arg)] = eval(want)
def solve(x):
    return answers.get(x)
"""

CUSTOM_EQ = "class Yes:\n    def __eq__(self, other):\n        return True\n\ndef solve(x):\n    return Yes()"


def test_the_three_known_exploits_and_a_custom_eq_score_zero(monkeypatch):
    seen_files = []
    real_run = sandbox.run

    async def spy(files, *args, **kwargs):  # what the sandbox is given
        seen_files.append(dict(files))
        return await real_run(files, *args, **kwargs)

    monkeypatch.setattr(sandbox, "run", spy)
    attackers = {"stack": STACK_READER, "patch_builtins": PATCHER, "read_files": FILE_READER, "custom_eq": CUSTOM_EQ}
    items = [Item("", code, metadata={"tests": SECRET_TESTS}) for code in [HONEST, *attackers.values()]]
    honest, *attacked = score(items, max_concurrency=2)
    assert honest.score == 1.0, honest
    for name, r in zip(attackers, attacked):
        assert r.status == "ok" and r.score == 0.0, (name, r)
    runs = [files for files in seen_files if "solution.py" in files]  # (the start-up probe is one more run)
    assert len(runs) == len(items)
    for files in runs:  # no expected value was ever written where the program runs (but the honest solution)
        assert files.keys() == {"solution.py", "probes.json", "_runner.py"}
        assert not any("918273645" in text or "zebra" in text for name, text in files.items() if name != "solution.py")


def test_the_program_output_and_exit_status_do_not_count():
    liar = 'import os\nprint(\'{"test": 0, "step": 0, "value": 918273645}\')\nos._exit(0)'
    (r,) = score([Item("", liar, metadata={"tests": SECRET_TESTS})])
    assert r.score == 0.0 and r.details["completed"] == 0.0


def test_untestable_tests_fail_the_item_as_bad_tests():
    (r,) = score([Item("", HONEST, metadata={"tests": ["x = 918273645\nassert solve(3) == x"]})], check_sandbox=False)
    assert r.status == "failed" and r.reason.startswith("bad_tests") and "literal" in r.reason


# --- limits for the whole process tree -------------------------------------------------------------
HOG = r'''
import os, time
def hog(children, mb):
    """Fork children that each hold `mb` MiB at once; return how many managed it."""
    r, w = os.pipe()
    for _ in range(children):
        if os.fork() == 0:
            try:
                block = b"\x01" * (mb << 20)  # written, so resident
                os.write(w, b"x")
                time.sleep(1.5)
            finally:
                os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 64):  # EOF once every child exited or was killed
        got += chunk
    return len(got)
'''


def test_forked_children_share_one_memory_limit():
    items = [
        Item("", HOG, metadata={"tests": ["assert hog(6, 100) == 6"]}),  # 600 MiB in all: over
        Item("", HOG, metadata={"tests": ["assert hog(6, 25) == 6"]}),
    ]  # 150 MiB in all: fits
    over, fits = score(items, memory_mb=256, timeout_s=15, max_concurrency=1)
    assert fits.score == 1.0, fits  # control: forking and holding memory works under the limit
    assert over.score == 0.0, over
    assert over.details["memory_peak_mb"] <= 260, over  # the item's processes together (rlimits alone: ~600)
    assert fits.details["memory_peak_mb"] >= 150, fits


BOMB = r"""
import os, time
def bomb():
    n = 0
    while True:
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
    time.sleep(2)  # hold every process while the other item runs
    return n
"""

FORKS_ONCE = r"""
import os, time
def add(a, b):
    time.sleep(1)  # the bomb beside it holds all it could get by now
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return a + b
"""


def test_a_fork_bomb_is_capped_per_item_and_does_not_starve_another_item():
    items = [
        Item("", BOMB, metadata={"tests": ["assert bomb() < 8"]}),
        Item("", FORKS_ONCE, metadata={"tests": ["assert add(2, 3) == 5"]}),
    ]
    bomb, honest = score(items, max_processes=8, max_concurrency=2, timeout_s=10)
    assert bomb.score == 1.0, bomb  # it could make at most 7 processes besides itself...
    # ...and the other item, running beside it as the same user, can still fork (with a per-user
    # RLIMIT_NPROC, isolation = "rlimits", its fork fails: the bomb holds the user's whole count)
    assert honest.score == 1.0, honest


def test_without_cgroups_it_refuses_to_start_unless_rlimits_are_accepted(monkeypatch, tmp_path):
    from reward_service.builtin import cgroups

    monkeypatch.setattr(cgroups, "MOUNTS", tmp_path)  # a machine with no cgroup file system
    with pytest.raises(sandbox.SandboxError, match='isolation = "rlimits"'):
        score([Item("", HONEST, metadata={"tests": SECRET_TESTS})])
    (r,) = score([Item("", HONEST, metadata={"tests": SECRET_TESTS})], isolation="rlimits")
    assert r.score == 1.0 and "memory_peak_mb" not in r.details
