"""The whole loop at tiny size, as `relay up` runs it: real redis-server, broker, reward service,
two torch generators and the DeepSpeed learner, each its own process."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.services import ROOT, child_env, relay, relay_up_args


@pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)
def test_loop_learns_and_versions_advance(tmp_path):
    res = relay(*relay_up_args(tmp_path, "loop", steps=100), timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    run = tmp_path / "loop"
    assert (tmp_path / "latest").resolve() == run
    s = json.loads((run / "summary.json").read_text())
    assert s["run_id"] == "loop" and s["steps"] == 100 and s["versions_published"] == 100
    assert 0.0 <= s["reward_first"] <= 1.0 and 0.0 <= s["reward_last"] <= 1.0
    assert s["reward_last"] > s["reward_first"] + 0.03, s  # the policy improved
    assert s["groups_trained"] == 100 * 32 and s["groups_rejected"] == 0
    a = s["audit"]  # every group accounted for
    assert a["trained_once"] == 100 * 32 and a["trained_twice"] == 0 and a["lost"] == 0
    assert a["produced"] == a["trained_once"] + a["dropped"] + a["queued"]
    assert s["redis_refused"] == []  # each service's least-privilege Redis user had every right it needed
    assert set(s["generators"]) == {"gen-0", "gen-1"}
    for g in s["generators"].values():
        assert g["backend"] == "torch" and g["version_applied"] >= 90 and g["groups_sent"] > 0
    for name in ("redis", "broker", "reward", "learner", "gen-0", "gen-1"):
        assert (run / "logs" / f"{name}.log").is_file()
    # every published version is an immutable, verified snapshot; old ones are pruned
    from broker.protocol import weightstore

    versions = weightstore.list_versions(run / "weights")
    assert versions[-1] == 100 and len(versions) <= 8
    weightstore.verify(weightstore.version_dir(run / "weights", 100))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)
def test_ctrl_c_stops_every_process(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "up",
            "--runs-dir",
            str(tmp_path),
            "--run-id",
            "int",
            "--dashboard-port",
            "0",
            "--no-progress",
        ],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = tmp_path / "int"
    deadline = time.monotonic() + 180
    metrics = run / "learner" / "metrics.jsonl"
    while time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    pids = json.loads((run / "pids.json").read_text())
    assert set(pids) == {"redis", "broker", "reward", "learner", "gen-0", "gen-1"}
    assert all(_alive(p) for p in pids.values())
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=150)  # ~10 s on an idle machine; the learner finishes its step and checkpoints
    assert proc.returncode == 130, out
    assert "SIGINT received" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"] is None, summary
    assert (tmp_path / "latest").resolve() == run.resolve()  # it started: its learner published versions
    left = [name for name, pid in pids.items() if _alive(pid)]
    assert not left, f"still alive after Ctrl-C: {left}"
    # nothing else of this run survives either (grandchildren included)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            assert str(run) not in cmd or not _alive(int(d.name)), f"orphan: {cmd}"
