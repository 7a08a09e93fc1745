"""code_exec runs the completion against unit tests in a real sandbox: an infinite loop is killed at
its time limit, a network connection is refused, files outside the sandbox cannot be read."""

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from reward_service.builtin import sandbox
from reward_service.plugins import REGISTRY, Item
from tests.support.services import ROOT


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
    out = score([Item("", good, metadata={"tests": tests}), Item("", half, metadata={"tests": tests}),
                 Item("", good, reference="assert add(2, 2) == 4"), Item("", early_exit, metadata={"tests": tests}),
                 Item("", good)])
    assert [r.score for r in out[:4]] == [1.0, 0.5, 1.0, 0.0]
    assert out[3].details["completed"] == 0.0  # exiting early does not pass
    assert out[4].status == "failed" and out[4].reason.startswith("no_tests")


def test_an_infinite_loop_is_killed_at_the_time_limit():
    t0 = time.monotonic()
    (r,) = score([Item("", "def f():\n    while True:\n        pass", reference="f()")], timeout_s=1.0)
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
        outside = subprocess.run([sys.executable, "-c", PROBE + f"\nprint(probe({port}))"], capture_output=True,
                                 text=True, timeout=30)
        assert outside.stdout.strip() == "connected"
        listener.accept()[0].close()
        tests = [f"assert probe({port}).startswith('blocked'), probe({port})",
                 "assert probe(53, '1.1.1.1').startswith('blocked')"]
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
    tests.append("open('/sandbox/mine.txt', 'w').write('x'); assert open('mine.txt').read() == 'x'")  # its own dir works
    (r,) = score([Item("", code, metadata={"tests": tests})])
    assert r.details["passed"] == r.details["total"] == len(tests), r


def test_the_probe_fails_clearly_when_namespaces_are_unavailable(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(sandbox.SandboxError, match="unshare"):
        asyncio.run(sandbox.probe())
