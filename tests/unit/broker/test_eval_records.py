"""Evaluation aggregation (broker/prompts/evals.py), TensorBoard records (learner/records.py), W&B off by
default, and the built-in task's resumable prompt source."""

import subprocess
import sys

import pytest

from broker.prompts.evals import pass_at_k, summarize_round
from broker.protocol.messages import EvalCompletion, EvalResult, EvalRound
from broker.prompts.datasets import Position
from broker.prompts.tasks import TaskConfig, TaskSource, prompt_stream
from tests.support.services import ROOT


def c(reward, length=3, status="ok"):
    return EvalCompletion(reward=reward, status=status, length=length)


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)


def test_round_summary_greedy_and_samples():
    meta = EvalRound(version=7, prompts=3, greedy=True, samples=2, threshold=1.0)
    results = {
        0: EvalResult(version=7, greedy=c(1.0, 4), samples=[c(1.0), c(0.0)]),
        1: EvalResult(version=8, greedy=c(0.5, 2), samples=[c(0.0), c(0.0)]),
        2: EvalResult(version=7, greedy=c(None, 6, "failed"), samples=[c(1.0), c(None, 3, "failed")]),
    }
    s = summarize_round(meta, results)
    assert s["version"] == 7 and s["n_prompts"] == 3 and s["complete"]
    assert s["pass@1"] == pytest.approx(1 / 3)  # a failed reward is not correct
    assert s["pass@k"] == pytest.approx(2 / 3) and s["k"] == 2
    assert s["mean_reward"] == pytest.approx(0.75)  # ok greedy rewards only; failures counted apart
    assert s["mean_length"] == pytest.approx(4.0)
    assert s["reward_failures"] == 2 and s["versions_served"] == [7, 8]
    assert s["sample_mean_reward"] == pytest.approx(0.4)
    partial = summarize_round(meta, {0: results[0]})
    assert not partial["complete"] and partial["n_prompts"] == 1


def test_a_round_is_labelled_with_the_version_that_answered_it():
    """every_versions = 10: the round the broker enqueued at version 10 was answered by 13 (or split
    between 11 and 14); its label is the version that answered, never the one that triggered it."""
    meta = EvalRound(version=10, prompts=4, greedy=True, samples=0, threshold=1.0)
    one = summarize_round(meta, {i: EvalResult(version=13, greedy=c(1.0)) for i in range(4)})
    assert (one["version"], one["round"], one["versions_served"], one["mixed"]) == (13, 10, [13], False)
    split = summarize_round(
        meta,
        {
            0: EvalResult(version=11, greedy=c(1.0)),
            1: EvalResult(version=14, greedy=c(0.0)),
            2: EvalResult(version=14, greedy=c(1.0)),
            3: EvalResult(version=11, greedy=c(1.0)),
        },
    )
    assert (split["version"], split["versions_served"], split["mixed"]) == (11, [11, 14], True)  # a tie: the older
    most = summarize_round(
        meta,
        {
            0: EvalResult(version=11, greedy=c(1.0)),
            1: EvalResult(version=14, greedy=c(1.0)),
            2: EvalResult(version=14, greedy=c(1.0)),
        },
    )
    assert most["version"] == 14 and most["mixed"]
    waiting = summarize_round(meta, {})  # nothing answered yet: the round's own version
    assert (waiting["version"], waiting["versions_served"], waiting["mixed"]) == (10, [], False)


def test_round_summary_samples_only_estimates_pass_at_1():
    meta = EvalRound(version=1, prompts=2, greedy=False, samples=4, threshold=0.5)
    s = summarize_round(
        meta, {0: EvalResult(samples=[c(1.0), c(0.0), c(0.0), c(0.0)]), 1: EvalResult(samples=[c(0.6)] * 4)}
    )
    assert s["pass@1"] == pytest.approx((0.25 + 1.0) / 2) and s["pass@k"] == 1.0


def test_tensorboard_event_files_parse_with_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from learner.records import RunRecords, WandbConfig, write_eval

    rec = RunRecords(tmp_path, tensorboard=True, wandb_cfg=WandbConfig(), run_id="x", config={})
    for step in (1, 2, 3):
        rec.log({"step": step, "reward_mean": step / 10, "staleness": {0: 5, 1: 2}, "group_rewards": [0.1]})
    rec.close()
    write_eval(
        tmp_path / "tensorboard",
        [{"version": 0, "pass@1": 0.0, "mean_reward": 0.1}, {"version": 3, "pass@1": 0.5, "mean_reward": 0.6}],
    )
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert {"reward_mean", "staleness/0", "eval/pass@1", "eval/mean_reward"} <= set(tags)
    assert [(e.step, round(e.value, 3)) for e in ea.Scalars("reward_mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [(e.step, e.value) for e in ea.Scalars("eval/pass@1")] == [(0, 0.0), (3, 0.5)]


def test_wandb_is_off_by_default_and_never_imported():
    code = (
        "import sys\nfrom learner.config import LearnerConfig\nfrom learner.records import RunRecords\n"
        "import tempfile\ncfg = LearnerConfig()\nassert not cfg.metrics.wandb.enabled\n"
        "RunRecords(tempfile.mkdtemp(), True, cfg.metrics.wandb, 'x', {}).close()\n"
        "assert 'wandb' not in sys.modules, 'wandb was imported'\nprint('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_task_source_resumes_exactly_where_it_was():
    cfg = TaskConfig(name="copy", seed=3)
    stream = prompt_stream(cfg)
    want = [next(stream).text for _ in range(25)]
    src, pos, got = TaskSource(cfg), Position(), []
    for k in (5, 1, 9, 10):
        recs, pos = TaskSource(cfg).take(k, pos) if k == 9 else src.take(k, pos)  # a fresh source resumes too
        got += [r.text for _, _, r in recs]
    assert got == want and pos.fed == 25
