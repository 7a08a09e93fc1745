"""A run whose dataset runs out before `learner.steps` ends cleanly, saying so (learner/intake.py,
learner/trainer.py), and per-step completion length and truncation reach metrics.jsonl with a
warning when most completions stop at max_tokens. One small `relay up` run serves both tests:
20 prompts, one epoch, 4 groups a step, `max_tokens = 1` (the copy task's answers need 4 tokens)."""

import json

import pytest

from tests.support.services import relay

STEPS = 50  # far more than the data gives: 20 prompts / 4 groups a step = 5 steps


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("end")
    (tmp / "d.jsonl").write_text("".join(json.dumps({"prompt": str(100 + 7 * i), "answer": str(100 + 7 * i)}) + "\n"
                                         for i in range(20)))
    (tmp / "run.toml").write_text(f"""
[broker.dataset]
path = "{tmp / 'd.jsonl'}"
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
    res = relay("up", "--config", str(tmp / "run.toml"), "--runs-dir", str(tmp / "runs"), "--run-id", "r",
                "--generators", "1", "--dashboard-port", "0", "--no-progress", timeout=300)
    return res, tmp / "runs" / "r"


@pytest.mark.slow  # one relay up run, about 30 s
def test_a_dataset_smaller_than_the_run_ends_it_cleanly_saying_so(run):
    res, run_dir = run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "the run will end when the data ends, near step 5" in res.stdout  # said before it starts
    assert "relay up: the run ended: the dataset ran out after 1 epoch(s) (20 prompts): trained 5 of 50 steps" \
        in res.stdout.strip().splitlines()[-1]
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
