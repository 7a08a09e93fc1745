"""metrics.jsonl and the dashboard's stream are strict JSON: a non-finite number becomes null and is
counted, never written as a bare NaN or Infinity. Each step's completion length and truncation, and
the warning when most completions are cut at max_tokens."""

import json
import math

import pytest

from learner.observe import finite_metrics


def test_non_finite_values_become_null_and_are_counted():
    diag = {
        "loss": math.nan,
        "mismatch_kl": math.inf,
        "ess": 0.9,
        "step": 3,
        "staleness": {"1": 8},
        "group_rewards": [0.5, -math.inf],
    }
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
    assert completion_stats([g, g2]) == {
        "completion_len_mean": (3 + 1 + 7 + 1) / 4,
        "completion_len_max": 7,
        "completion_truncated_frac": 3 / 4,
    }


def test_the_truncation_warning_needs_most_completions_cut_over_the_last_steps(caplog):
    from collections import deque
    from types import SimpleNamespace

    from broker.protocol.keys import Keys
    from learner.steplog import TRUNCATED_WARN_STEPS, StepLog

    written = {}
    me = SimpleNamespace(
        recent_truncated=deque(maxlen=TRUNCATED_WARN_STEPS),
        warned_truncated=False,
        keys=Keys("t"),
        r=SimpleNamespace(hset=lambda key, field, value: written.update({field: value})),
    )
    # a random-init model's long first answers: one bad step among short ones does not warn
    for step, frac in enumerate([0.9, 0.4, 0.3, 0.3, 0.2, 0.2], 1):
        StepLog.warn_if_truncated(me, {"step": step, "completion_truncated_frac": frac, "completion_len_mean": 5.0})
    assert not me.warned_truncated and not written
    for step, frac in enumerate([0.9, 0.95, 1.0, 0.8, 0.9, 1.0, 1.0], 7):
        StepLog.warn_if_truncated(me, {"step": step, "completion_truncated_frac": frac, "completion_len_mean": 8.0})
    # warned at step 8, the first window above one half: 0.3, 0.2, 0.2, 0.9, 0.95
    assert me.warned_truncated and written["truncated_warning_frac"] == pytest.approx(0.51)
    assert sum("stopped at max_tokens" in r.getMessage() for r in caplog.records) == 1  # once
