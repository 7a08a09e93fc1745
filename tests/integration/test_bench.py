"""`relay bench --quick` completes and writes a report of the agreed shape. No assertion on speed:
the machines are shared, a benchmark reports and never fails on time (figures: docs/benchmarks.md)."""

import json
import math

import pytest

from tests.support.services import relay

NAMES = {
    "codec",
    "ingest",
    "weight_sync/store",
    "weight_sync/learner_blocked",
    "weight_sync/http",
    "weight_sync/collective",
    "weight_sync/lora",
    "overlap",
    "async_speedup/eta1",
    "generator/torch",
    "generator/vllm",
    "learner",
    "learner_memory",
    "learner_memory/step_time",
    "learner_forwards/shared_prompt",
    "learner_forwards/packing",
    *(f"ingest_scaling/{p}p/{w}w" for p in (1, 4) for w in (1, 2)),
    *(f"fanout/{t}" for t in ("store", "http", "collective")),
}  # --quick: 1 and 4 producers; fanout: 1 and 2 receivers


@pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)
def test_relay_bench_quick_writes_every_benchmark_with_its_baseline(tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    # ~240 s on an idle machine; a loaded CI runner has taken over 400 s
    res = relay("bench", "--quick", "--json", str(out), "--md", str(md), timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    m = report["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["versions"]["torch"] and m["versions"]["redis-server"]
    assert report["quick"] is True
    rows = {r["name"]: r for r in report["benchmarks"]}
    assert set(rows) == NAMES
    for name, r in rows.items():
        assert {"value", "baseline", "ratio", "target", "unit", "met"} <= set(r), name
        assert "error" not in r, (name, r.get("error"))
        if r.get("skipped"):
            # vLLM missing, or a weight transport not built yet (issue 18)
            assert (
                name.endswith(("/vllm", "/http", "/collective")) and isinstance(r["skipped"], str) and r["skipped"]
            ), name
            continue
        # fanout's value is a fitted slope (seconds per added receiver): at the tiny size it may be ~0 or below
        assert math.isfinite(r["value"]) if name.startswith("fanout/") else r["value"] > 0, name
        assert r["baseline"] > 0 and r["unit"], name
        assert math.isclose(r["ratio"], r["value"] / r["baseline"]), name
        assert r["met"] is None if r["target"] is None else isinstance(r["met"], bool), name
    assert rows["overlap"]["details"]["ideal_speedup"] >= 1.0
    assert 0.0 <= rows["overlap"]["details"]["learner_idle_fraction_async"] <= 1.0
    speedup = rows["async_speedup/eta1"]["details"]  # --quick: one seed, sync and η = 1, to a low reward
    assert [(r["eta"], r["reached"]) for r in speedup["runs"]] == [(0, True), (1, True)], speedup["runs"]
    assert speedup["correction"]["mode"] == "tis" and speedup["speedup_of_medians"] > 0
    for t in ("store", "http", "collective"):  # every receiver applied every version, via the transport measured
        fan = rows[f"fanout/{t}"]["details"]
        assert [p["receivers"] for p in fan["points"]] == [1, 2], fan
        assert all(len(a) == p["receivers"] for p in fan["points"] for a in p["applied_after_s"]), fan
    table = md.read_text()
    assert "| benchmark |" in table and all(f"| {n} |" in table for n in NAMES)
    assert table in res.stdout  # the same table is printed


def test_relay_bench_rejects_an_unknown_name():
    res = relay("bench", "--quick", "nope")
    assert res.returncode == 2 and "unknown benchmark(s) nope" in res.stderr and "codec" in res.stderr
