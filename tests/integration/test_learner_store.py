"""The learner's process group listens on 127.0.0.1 at most: one rank has no store listening (an in-memory
store; before, a torch TCPStore on a port picked free and bound later, which another run could take in
between (`DistNetworkError ... EADDRINUSE`), listening on every interface), and the ranks that
`relay up --learner-ranks N` starts (deploy/launcher/ranks.py) meet at a store their launcher binds on
127.0.0.1 (torchrun --standalone's listened on `[::]`), with gloo's links on the loopback interface."""

import json
import subprocess
import sys

import pytest

from tests.support.services import ROOT, child_env


def _report(out):
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    return [x for x in lines if "port" in x], lines[-1]


@pytest.mark.slow  # DeepSpeed's process group in one process, then two (~30 s)
def test_the_learners_process_group_listens_on_nothing_with_one_rank_and_on_loopback_with_two(tmp_path):
    env = {k: v for k, v in child_env().items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    one = tmp_path / "one.jsonl"
    res = subprocess.run(
        [sys.executable, "-m", "tests.support.store_listeners", str(one)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    listeners, info = _report(one)
    assert info["world"] == 1 and info["master_port"] is None
    # no store at all; gloo's device (it listens even with no peer, on a port the kernel gives it) on loopback
    assert len(listeners) <= 1 and all(x["address"] == "127.0.0.1" for x in listeners), listeners

    two = tmp_path / "two.jsonl"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy.launcher.ranks",
            "2",
            sys.executable,
            "-m",
            "tests.support.store_listeners",
            str(two),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    listeners, info = _report(two)
    assert info["world"] == 2 and info["sum"] == 2.0
    store = [x for x in listeners if x["who"] == "launcher"]
    assert [(x["address"], x["port"]) for x in store] == [("127.0.0.1", int(info["master_port"]))], listeners
    assert listeners and all(x["address"] == "127.0.0.1" for x in listeners), listeners  # gloo's links too


def test_a_failing_rank_stops_the_others_and_its_code_is_the_launchers(tmp_path):
    """deploy/launcher/ranks.py watches its ranks as torchrun does: one exits with an error, the other
    (which would run for a minute) is stopped, and the launcher exits with that rank's code."""
    script = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(7)\ntime.sleep(60)\n"
    res = subprocess.run(
        [sys.executable, "-m", "deploy.launcher.ranks", "2", sys.executable, "-c", script],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert res.returncode == 7 and "rank 1 exited with code 7; stopping the other ranks" in res.stderr, res
