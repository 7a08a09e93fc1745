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


def test_completion_length_and_truncation_per_step():
    import numpy as np

    from learner.data import completion_stats
    from tests.support.data import make_group

    g = make_group()  # two samples: 3 tokens "stop", 1 token "length"
    g2 = make_group(group_id="g2")
    g2.samples[0].completion_ids = np.arange(7, dtype=np.int32)
    g2.samples[0].finish_reason = "length"
    assert completion_stats([g, g2]) == {"completion_len_mean": (3 + 1 + 7 + 1) / 4, "completion_len_max": 7,
                                         "completion_truncated_frac": 3 / 4}
