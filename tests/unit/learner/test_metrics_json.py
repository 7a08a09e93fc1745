"""metrics.jsonl and the dashboard's stream are strict JSON: a non-finite number becomes null and is
counted, never written as a bare NaN or Infinity."""

import json
import math

from learner.observe import finite_metrics


def test_non_finite_values_become_null_and_are_counted():
    diag = {"loss": math.nan, "mismatch_kl": math.inf, "ess": 0.9, "step": 3, "staleness": {"1": 8},
            "group_rewards": [0.5, -math.inf]}
    out = finite_metrics(diag)
    assert out["loss"] is None and out["mismatch_kl"] is None and out["group_rewards"] == [0.5, None]
    assert out["ess"] == 0.9 and out["step"] == 3 and out["staleness"] == {"1": 8}
    assert out["metrics_nonfinite"] == 3
    text = json.dumps(out, allow_nan=False)
    json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # no NaN/Infinity tokens


def test_finite_metrics_count_zero():
    assert finite_metrics({"loss": 0.1})["metrics_nonfinite"] == 0
