"""The reward benchmark runs (quick size) and reports its figures in the agreed shape (no speed assertion:
the figures at full size are in docs/rewards.md)."""

import pytest

from benchmarks.rewards import run


def test_reward_benchmark_quick_reports_throughput_and_overhead():
    r = run(quick=True)
    assert r["name"] == "reward_http" and r["unit"] == "items/s" and r["target"] == 5000
    assert r["value"] > 0 and r["baseline"] > 0
    assert r["ratio"] == pytest.approx(r["value"] / r["baseline"])
    assert r["details"]["batch"] == 256 and r["details"]["ms_per_batch_http"] > 0
