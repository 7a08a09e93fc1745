"""A learner across nodes: `relay up --learner-ranks 2 --learner-nodes 2` runs the learner as two torchrun
"nodes" on this machine (two `relay learner --nnodes 2` processes, each torchrun's elastic agent with one
rank, meeting at a c10d rendezvous that node 0 hosts on 127.0.0.1; deploy/launcher/nodes.py), beside the
broker, the reward service and two generators.

- It trains the default task to `make run`'s threshold (mean reward 0.9: learner.target.reward), with
  every group trained once and none lost, and nothing of the learner's listens beyond 127.0.0.1.
- Killing one node, then the other (the one that hosts the rendezvous), with SIGKILL mid-run (the node's agent
  and its rank, as a machine that dies): torchrun stops the job's ranks on every node and starts them again
  after a new rendezvous, every rank resumes from the last checkpoint, and the run finishes with lost 0 and
  trained twice 0."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.services import ROOT, child_env, relay_up_args
from tests.support.store_listeners import listening


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (by parent pid: torchrun's ranks are children of its agent, in a
    session of their own)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


def _pids(run: Path) -> dict[str, int]:
    try:
        return json.loads((run / "pids.json").read_text())
    except (OSError, ValueError):
        return {}


def _step(run: Path) -> int:
    try:
        lines = (run / "learner" / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return json.loads(lines[-1])["step"] if lines and lines[-1].strip() else 0


def _start(tmp_path: Path, run_id: str, steps: int, *sets: str) -> subprocess.Popen:
    args = relay_up_args(tmp_path, run_id, "--learner-ranks", "2", "--learner-nodes", "2", steps=steps, sets=sets)
    return subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-m", "deploy.cli", *args],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # relay up stops every service by PID and still writes its summary
        out, _ = proc.communicate(timeout=120)
        out = f"relay up did not finish in {timeout:.0f} s\n{out}"
    return out


@pytest.mark.slow  # the default task trained to reward 0.9 by a learner of two nodes (~4-8 min on 2 cores)
def test_a_learner_of_two_nodes_trains_the_default_task_to_make_runs_threshold(tmp_path):
    run = tmp_path / "nodes"
    proc = _start(tmp_path, "nodes", 1500, "learner.target.reward=0.9")
    listeners: list[dict] = []
    try:
        while proc.poll() is None and _step(run) < 5:  # the job trains: both nodes' ranks are up
            time.sleep(1)
        pids = _pids(run)
        learner = {p: name for name in ("learner", "learner-1") if name in pids for p in _descendants(pids[name])}
        listeners = listening(learner)
    finally:
        out = _finish(proc, 1500)
    assert proc.returncode == 0, out[-4000:]
    # node 0's agent hosts the rendezvous, rank 0 the ranks' store, each rank its gloo links: the loopback only
    assert len({x["pid"] for x in listeners}) >= 3, listeners
    assert all(x["address"].startswith("127.") for x in listeners), listeners
    s = json.loads((run / "summary.json").read_text())
    assert s["ended"].startswith("reached the target reward 0.9"), (s["ended"], out[-3000:])
    a = s["audit"]
    assert a["lost"] == 0 and a["trained_twice"] == 0 and a["trained_once"] == s["groups_trained"], a
    log = (run / "logs" / "learner.log").read_text()
    assert "node 0 of 2" in log and "rendezvous 127.0.0.1:" in log and "on 2 rank(s)" in log
    assert "node 1 of 2" in (run / "logs" / "learner-1.log").read_text()


def _kill_node(run: Path, name: str) -> int:
    """SIGKILL node ``name`` as a machine that dies: its agent and its rank together. torchrun starts each rank
    in a session of its own, so the agent's process group alone would leave the rank training on (an agent
    killed alone: docs/deploy.md, "A learner across nodes")."""
    pid = _pids(run)[name]
    assert "--nnodes" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"), name
    node = _descendants(pid)
    assert len(node) >= 2, node  # the agent and its rank
    for p in node:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pid


@pytest.mark.slow  # two kills, two whole-job restarts from a checkpoint (~3-5 min on 2 cores)
def test_a_node_killed_mid_run_restarts_the_job_from_its_checkpoint_with_nothing_lost_or_trained_twice(tmp_path):
    steps, groups = 60, 8
    run = tmp_path / "kill"
    proc = _start(tmp_path, "kill", steps, f"learner.batch.groups={groups}", "learner.publish.checkpoint_every=10")
    killed = []
    try:
        for name, at in (("learner-1", 15), ("learner", 35)):  # node 1; then node 0, the rendezvous' host
            while proc.poll() is None and _step(run) < at:
                time.sleep(0.5)
            if proc.poll() is None:
                killed.append((name, _step(run), _kill_node(run, name)))
    finally:
        out = _finish(proc, 900)
    assert proc.returncode == 0, out[-4000:]
    assert [k[0] for k in killed] == ["learner-1", "learner"], killed
    s = json.loads((run / "summary.json").read_text())
    a = s["audit"]
    assert a["lost"] == 0 and a["trained_twice"] == 0, (a, out[-3000:])
    assert a["trained_once"] == steps * groups and s["steps"] == steps, (a, s["steps"])
    assert s["restarts"].get("learner-1", 0) >= 1 and s["restarts"].get("learner", 0) >= 1, s["restarts"]
    # rank 0 runs on node 0 (127.0.0.1 sorts before 127.0.0.2), so the leader's lines are in node 0's log: the
    # job started 3 times (the run, after each kill), and each start after the first resumed from a checkpoint
    log = (run / "logs" / "learner.log").read_text()
    starts = log.count("published initial version") + log.count("continuing from announced version")
    resumed = [int(x.split()[0]) for x in log.split("resumed from checkpoint at step ")[1:]]
    assert starts >= 3 and len(resumed) == starts - 1, (starts, resumed, log[-3000:])
    assert resumed[0] <= killed[0][1] and resumed[-1] <= killed[1][1], (resumed, killed)  # not from later steps
    assert "resumed from checkpoint" not in (run / "logs" / "learner-1.log").read_text()
    metrics = [json.loads(x) for x in (run / "learner" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))  # steps redone are not reported twice
