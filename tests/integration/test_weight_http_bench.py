"""benchmarks/weight_sync.py ``_bench_http`` at tiny size: two real generator processes with the http transport
and no weight store apply each version over HTTP, and the row has the agreed shape, with its raw baseline
(a plain HTTP GET of the same bytes) measured in the same run. No assertion on speed (shared machines)."""

import math
import tempfile
from pathlib import Path

import pytest


@pytest.mark.slow  # starts two generator processes (left to `make test`, docs/testing.md)
def test_bench_http_row_from_two_generators():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.common import Stack, bench_model
    from benchmarks.weight_sync import _bench_http

    with tempfile.TemporaryDirectory(prefix="relay-bench-http-") as tmp, Stack(Path(tmp)) as stack:
        base = bench_model(Path(tmp) / "base", quick=True)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        r = _bench_http(model, AutoTokenizer.from_pretrained(base), Path(tmp), stack, versions=2)
        caches = [sorted(p.name for p in (Path(tmp) / f"http-cache-{i}").iterdir()) for i in (0, 1)]
    assert r["name"] == "weight_sync/http" and r["value"] > 0 and r["baseline"] > 0
    assert math.isclose(r["ratio"], r["value"] / r["baseline"]) and isinstance(r["met"], bool)
    d = r["details"]
    assert len(d["per_version_s"]) == len(d["raw_per_version_s"]) == 2
    # versions 0, 1 and 2 went to both generators over HTTP (the manifest and every file, each time)
    assert d["bytes_served"] >= 2 * 3 * d["version_bytes"] * 0.9
    assert caches == [["v000000", "v000001", "v000002"]] * 2
