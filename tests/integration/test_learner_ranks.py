"""`relay up --learner-ranks 2`: two DeepSpeed processes (torchrun, gloo on CPU), each training on
its own half of every batch, hold identical weights after every step."""

import json

import pytest

from tests.support.services import relay


@pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)
def test_two_learner_ranks_stay_identical(tmp_path):
    steps = 8
    res = relay("up", "--learner-ranks", "2", "--steps", str(steps), "--runs-dir", str(tmp_path), "--run-id", "r2",
                "--dashboard-port", "0", "--no-progress", "--set", "learner.rank_checksums=true",
                "--set", "learner.batch_groups=8", timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = tmp_path / "r2"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["groups_trained"] == steps * 8
    assert summary["audit"]["trained_once"] == steps * 8 and summary["audit"]["lost"] == 0
    sums = [[json.loads(x) for x in (run / "learner" / f"rank-{r}.checksums").read_text().splitlines()]
            for r in (0, 1)]
    assert [c["step"] for c in sums[0]] == [c["step"] for c in sums[1]] == list(range(1, steps + 1))
    for a, b in zip(*sums):
        assert a["sha256"] == b["sha256"], f"ranks diverged at step {a['step']}"
    assert len({c["sha256"] for c in sums[0]}) == steps  # and the weights did change every step
    assert "on 2 rank(s)" in (run / "logs" / "learner.log").read_text()


def test_batch_must_split_evenly_across_ranks(tmp_path):
    res = relay("up", "--learner-ranks", "3", "--runs-dir", str(tmp_path), "--dashboard-port", "0")
    assert res.returncode == 2 and "multiple of --learner-ranks" in res.stderr and "Traceback" not in res.stderr
