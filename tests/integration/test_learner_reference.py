"""The reference-model role: with kl_coef > 0 the learner keeps a frozen copy of the initial
weights and adds a KL(π_θ || π_ref) term; the entropy of the sampling distribution is reported.
Sampled with temperature, top-k and top-p (issue 16's reproduction): tokens sampled by version v fall
outside the kept set of version v+1; they are masked and counted, every step's loss stays finite and
metrics.jsonl is strict JSON. With LoRA the reference is the same model with its adapters disabled (no
copy): the KL starts at 0 (the adapters start as the identity) and grows as they train."""

import json
import math

import pytest

from tests.support.services import relay, relay_up_args


def _strict(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"bare {constant} in metrics.jsonl")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)
@pytest.mark.parametrize("lora", [0, 8], ids=["full", "lora"])
def test_kl_to_the_reference_starts_at_zero_and_grows(tmp_path, lora):
    res = relay(
        *relay_up_args(
            tmp_path,
            "kl",
            steps=6,
            sets=(
                "learner.regularization.kl_coef=0.1",
                "learner.regularization.entropy_coef=0.01",
                f"learner.lora.rank={lora}",
                "learner.batch.groups=8",
                "generator.sampling.temperature=0.8",
                "generator.sampling.top_k=8",
                "generator.sampling.top_p=0.95",
            ),
        ),
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = (tmp_path / "kl" / "learner" / "metrics.jsonl").read_text().splitlines()
    metrics = [_strict(x) for x in lines]
    assert metrics[0]["kl_ref"] == 0.0  # the first step trains the reference's own weights
    assert all(m["kl_ref"] > 0 for m in metrics[1:])
    assert 0 < metrics[0]["entropy"] <= math.log(8) + 1e-6  # top-k 8: at most log 8 nats
    assert all(
        m["metrics_nonfinite"] == 0 and math.isfinite(m["loss"]) and math.isfinite(m["mismatch_kl"]) for m in metrics
    )
    # stale tokens fell out of the kept set, and were counted; only stale ones can: in a run where the learner
    # waited for every group (all of staleness 0, seen once in CI under load) there is nothing to count
    stale = [m for m in metrics[1:] if any(int(k) > 0 for k in m["staleness"])]
    assert not stale or sum(m["tokens_outside_kept_set"] for m in stale) > 0, [m["staleness"] for m in metrics]
    assert all(0 <= m["padding_fraction"] < 1 for m in metrics)
