"""A run whose dataset runs out before `learner.steps` ends cleanly, saying so (learner/intake.py,
learner/trainer.py), and per-step completion length and truncation reach metrics.jsonl with a
warning when most completions stop at max_tokens. One small `relay up` run serves both tests:
20 prompts, one epoch, 4 groups a step, `max_tokens = 1` (the copy task's answers need 4 tokens).
And Ctrl-C at the very end, while `relay up` waits for the final evaluation round."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from broker.protocol.keys import Keys
from deploy.launcher.run_secrets import run_redis_url
from tests.support.services import child_env, relay, wait_until

STEPS = 50  # far more than the data gives: 20 prompts / 4 groups a step = 5 steps


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("end")
    (tmp / "d.jsonl").write_text(
        "".join(json.dumps({"prompt": str(100 + 7 * i), "answer": str(100 + 7 * i)}) + "\n" for i in range(20))
    )
    (tmp / "run.toml").write_text(f"""
[broker.dataset]
path = "{tmp / "d.jsonl"}"
task = "copy"
epochs = 1

[broker.eval]
every_versions = 0

[learner]
steps = {STEPS}
batch_groups = 4

[generator]
prompts_per_batch = 2

[generator.sampling]
n = 2
max_tokens = 1
""")
    res = relay(
        "up",
        "--config",
        str(tmp / "run.toml"),
        "--runs-dir",
        str(tmp / "runs"),
        "--run-id",
        "r",
        "--generators",
        "1",
        "--dashboard-port",
        "0",
        "--no-progress",
        timeout=300,
    )
    return res, tmp / "runs" / "r"


@pytest.mark.slow  # one relay up run, about 30 s
def test_a_dataset_smaller_than_the_run_ends_it_cleanly_saying_so(run):
    res, run_dir = run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "the run will end when the data ends, near step 5" in res.stdout  # said before it starts
    assert (
        "relay up: the run ended: the dataset ran out after 1 epoch(s) (20 prompts): trained 5 of 50 steps"
        in res.stdout.strip().splitlines()[-1]
    )
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 5 and s["ended"].startswith("the dataset ran out")
    # every prompt trained once, nothing lost, and the last weights exported
    assert s["audit"]["trained_once"] == 20 and s["audit"]["lost"] == 0 and s["audit"]["trained_twice"] == 0
    assert s["export"]["version"] == s["versions_published"] == 5


@pytest.mark.slow
def test_completions_cut_at_max_tokens_show_in_the_metrics_with_a_warning(run):
    res, run_dir = run
    metrics = [json.loads(ln) for ln in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    for m in metrics:
        assert m["completion_len_max"] == 1 and m["completion_len_mean"] <= 1
        # a completion stops early only if its one token is EOS (1 in 15 for the random tiny model)
        assert m["completion_truncated_frac"] >= 0.5, m
    assert sum(m["completion_truncated_frac"] for m in metrics) / 5 > 0.75
    warnings = [ln for ln in res.stdout.splitlines() if "stopped at max_tokens" in ln]
    assert len(warnings) == 1 and "raise generator.sampling.max_tokens = 1" in warnings[0], res.stdout
    assert "stopped at max_tokens" in (run_dir / "logs" / "learner.log").read_text()


@pytest.mark.slow  # one relay up run, about 40 s
def test_ctrl_c_while_relay_up_waits_for_the_final_evaluation_stops_it_promptly_with_its_summary(tmp_path):
    """Ctrl-C while `relay up` waits for the generators to answer the final evaluation round (up to
    `broker.eval.final_timeout_s`) stops the run at once, says so, and writes summary.json: the learner
    has finished its steps, so the run is complete, without that round. The round is made to take
    longer than the wait it gets by freezing (SIGSTOP) both generators once they have produced every
    group the learner needs (the learner frozen meanwhile, so that it does not finish first); they are let
    go (SIGCONT) once relay up says it is stopping. Before, the signal was ignored until the wait ran out
    (here 150 s), with nothing printed."""
    run = tmp_path / "runs" / "r"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "up",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--run-id",
            "r",
            "--steps",
            "2",
            "--generators",
            "2",
            "--dashboard-port",
            "0",
            "--no-progress",
            "--set",
            "learner.batch.groups=4",
            "--set",
            "learner.batch.admission_eta=null",
            "--set",
            "broker.eval.every_versions=100",
            "--set",
            "broker.eval.prompts=4",
            "--set",
            "broker.eval.final_timeout_s=150",
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    frozen: list[int] = []

    def freeze(*names: str) -> None:
        pids = json.loads((run / "pids.json").read_text())
        for name in names:
            os.killpg(pids[name], signal.SIGSTOP)
            frozen.append(pids[name])

    def thaw() -> None:
        while frozen:
            os.killpg(frozen.pop(), signal.SIGCONT)

    try:
        wait_until(
            lambda: (run / "pids.json").is_file() and (run / "secrets" / "redis").is_dir(), 300, "the run's start"
        )
        r, keys = redis.Redis.from_url(run_redis_url(run)), Keys("r")
        wait_until(lambda: r.exists(keys.latest) or proc.poll() is not None, 600, "the learner's first version")
        freeze("learner")
        # every group the learner's two steps need (with room for a few dropped stale) is in the queue
        wait_until(lambda: r.scard(keys.seen) >= 16 or proc.poll() is not None, 300, "the generators' groups")
        freeze("gen-0", "gen-1")
        os.killpg(frozen.pop(0), signal.SIGCONT)  # the learner trains its two steps from the queue and ends
        wait_until(
            lambda: (
                any("waiting for the generators to answer the final evaluation round" in ln for ln in lines)
                or proc.poll() is not None
            ),
            300,
            "the learner's last step",
        )
        assert proc.poll() is None, "".join(lines)[-3000:]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        wait_until(
            lambda: any("received while the generators answered the final evaluation round" in ln for ln in lines),
            10,
            "relay up to take the signal",
        )
        thaw()
        rc = proc.wait(60)  # the usual grace: each service's stop waits at most 60 s
        took = time.monotonic() - t0
    finally:
        thaw()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines)
    assert rc == 0 and took < 60, (rc, took, out[-3000:])
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "completed" and s["steps"] == 2, s
    assert s["ended"] == "finished its 2 steps (the final evaluation round cut short by SIGINT)", s
    assert s["export"]["version"] == s["versions_published"] == 2
    assert (
        "SIGINT received while the generators answered the final evaluation round; the learner has finished its "
        "steps: stopping every service without that round" in out
    )
