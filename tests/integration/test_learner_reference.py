"""The reference-model role: with kl_coef > 0 the learner keeps a frozen copy of the initial
weights and adds a KL(π_θ || π_ref) term; the entropy of the sampling distribution is reported."""

import json
import math

import pytest

from tests.support.services import relay


@pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)
def test_kl_to_the_reference_starts_at_zero_and_grows(tmp_path):
    res = relay("up", "--steps", "6", "--runs-dir", str(tmp_path), "--run-id", "kl", "--dashboard-port", "0",
                "--no-progress", "--set", "learner.kl_coef=0.1", "--set", "learner.entropy_coef=0.01",
                "--set", "learner.batch_groups=8", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    metrics = [json.loads(x) for x in (tmp_path / "kl" / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["kl_ref"] == 0.0  # the first step trains the reference's own weights
    assert all(m["kl_ref"] > 0 for m in metrics[1:])
    assert 0 < metrics[0]["entropy"] <= math.log(15) + 1e-6  # 15 symbols: at most log 15 nats
