"""docs/scaling.md's projection (benchmarks/capacity.py): the formulas on a report of known figures, the line
fit of relay bench fanout, and the tables in docs/scaling.md are the ones its JSON gives (every projected
figure traceable to docs/benchmarks/scaling.json)."""

import json
import math
from pathlib import Path

import pytest

from benchmarks.capacity import MODELS, Scenario, fanout_table, inputs, markdown, saturates_at, utilization
from benchmarks.fanout import fit

ROOT = Path(__file__).resolve().parents[3]


def _report() -> dict:
    fan = {
        t: {
            "name": f"fanout/{t}",
            "value": slope,
            "baseline": 1.0,
            "details": {
                "fit": {"slope": slope, "intercept": 1.0 - slope, "r2": 1.0},
                "points": [{"receivers": n, "latency_s": 1.0 + slope * (n - 1)} for n in (1, 2, 4, 8)],
                "version_bytes": 10**9,
                "learner_cpu_s_per_receiver": 0.5,
            },
        }
        for t, slope in (("store", 0.25), ("http", 0.5), ("collective", 0.125))
    }
    ingest = {
        "name": "ingest",
        "value": 1000.0,  # groups/s
        "details": {
            "samples": 8,
            "tokens_per_sample": 1000,
            "broker_MB_per_s": 80.0,  # 80 kB a group: 10 bytes a token
            "broker_cpu_us_per_group": {"broker": 800.0, "redis": 80.0, "producers": 1.0, "consumer": 1.0},
        },
    }
    return {"machine": {"commit": "abc"}, "benchmarks": [ingest, *fan.values()]}


def test_inputs_are_read_from_the_rows_they_name():
    m = inputs(_report())
    assert m["bytes_per_token"] == pytest.approx(10.0)
    assert m["broker_us_per_token"] == pytest.approx(0.1) and m["redis_us_per_token"] == pytest.approx(0.01)
    assert m["http"]["learner_cpu_s_per_byte"] == pytest.approx(0.5e-9)
    assert m["collective"]["slope_s"] == 0.125 and m["store"]["receivers"] == [1, 2, 4, 8]


def test_utilization_follows_the_formulas():
    s = Scenario()
    m = inputs(_report())
    model = {"params": 1e9, "generator_gpus": 1, "tokens_per_s": 1000.0}
    u = utilization(m, model, 10, s)
    p = 10 * 1000.0
    assert u["tokens_per_s"] == p and u["groups_per_s"] == pytest.approx(p / s.tokens_per_group)
    assert u["ingest"] == pytest.approx(p * 0.1e-6 / s.broker_cores)
    assert u["redis_cpu"] == pytest.approx(p * 0.01e-6)
    assert u["redis_memory"] == pytest.approx(p * s.queue_s * 10 / s.redis_memory_bytes)
    flops = s.learner_gpus * s.gpu_flops * s.mfu
    assert u["learner"] == pytest.approx(p * s.flops_per_token_per_param * 1e9 / flops)
    fan = p / s.tokens_per_step * 10 * 2e9  # versions/s × generators × bytes a version
    assert u["fanout_nic"] == pytest.approx(fan / s.nic_bytes_per_s)
    assert u["fanout_cpu"] == pytest.approx(fan * 0.5e-9 / s.sending_cores)
    # linear parts saturate at G / u, the fan-out (G²) at G / √u
    g = saturates_at(m, model, s)
    assert utilization(m, model, g["learner"], s)["learner"] == pytest.approx(1.0)
    assert utilization(m, model, g["fanout_nic"], s)["fanout_nic"] == pytest.approx(1.0)


def test_fit_is_least_squares():
    f = fit([1, 2, 4, 8], [1.0, 1.5, 2.5, 4.5])
    assert f["slope"] == pytest.approx(0.5) and f["intercept"] == pytest.approx(0.5) and f["r2"] == pytest.approx(1.0)
    g = fit([1, 2, 4, 8], [1.0, 2.0, 2.0, 5.0])
    assert 0 < g["r2"] < 1 and math.isfinite(g["slope"])


def test_markdown_names_every_model_and_fleet():
    md = markdown(_report())
    assert all(f"| {name} | {g} |" in md for name in MODELS for g in (8, 64, 512))
    assert "| `http` |" in fanout_table(_report())


def test_docs_scaling_tables_are_the_ones_its_json_gives():
    doc = (ROOT / "docs" / "scaling.md").read_text()
    report = json.loads((ROOT / "docs" / "benchmarks" / "scaling.json").read_text())
    assert fanout_table(report) in doc, "docs/scaling.md: rerun python -m benchmarks.capacity and paste its tables"
    assert markdown(report) in doc, "docs/scaling.md: rerun python -m benchmarks.capacity and paste its tables"
