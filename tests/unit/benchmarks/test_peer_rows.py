"""relay bench peer's rows from finished runs (benchmarks/peer.py ``rows_from``, also ``--rows-from``): the
medians over seeds, Relay against TRL, the per-seed pass@1 differences, the time to the target or why it has
no row."""

import statistics

import pytest

from benchmarks.peer import rows_from, summarise


def _run(system, seed, per_step, passes, reach_at=None):
    steps = [
        {
            "step": k,
            "t": 100.0 + per_step * (k - 1),
            "tokens": 3000,
            "wait_s": 1.0,
            "train_s": 50.0,
            "publish_s": 0.1,
            "gen_s": 20.0,
            "prepare_s": 0.1,
        }
        for k in range(1, 5)
    ]
    curve = [
        {"step": k, "t": (100.0 + per_step * (k - 1)) if k else 0.0, "pass_at_1": p} for k, p in zip((0, 2, 4), passes)
    ]
    run = {"system": system, "seed": seed, "precision": "fp32", "steps": steps, "curve": curve}
    run["summary"] = summarise(run, 4)
    return run


def test_rows_are_medians_over_seeds_with_the_per_seed_differences():
    runs = [
        _run("relay-torch", 0, 50.0, [0.2, 0.6, 0.95]),
        _run("trl", 0, 80.0, [0.2, 0.5, 0.92]),
        _run("relay-torch", 1, 60.0, [0.2, 0.5, 0.91]),
        _run("trl", 1, 90.0, [0.2, 0.7, 0.96]),
    ]
    res = rows_from(runs)
    rows = {r["name"]: r for r in res["rows"]}
    wall = rows["peer/relay-torch/fp32/wall_to_4_steps"]
    assert wall["value"] == pytest.approx(100 + 3 * 55) and wall["baseline"] == pytest.approx(100 + 3 * 85)
    p = rows["peer/relay-torch/fp32/pass_at_1_step_4"]["details"]
    assert p["relay_minus_trl_per_seed"] == pytest.approx([0.03, -0.05])
    reach = rows["peer/relay-torch/fp32/wall_to_pass_0.9"]
    assert reach["value"] == pytest.approx(statistics.median([250.0, 280.0]))
    assert reach["baseline"] == pytest.approx(statistics.median([340.0, 370.0]))


def test_no_time_to_target_row_when_a_run_never_reaches_it_and_mixed_step_counts_refused():
    runs = [_run("relay-torch", 0, 50.0, [0.2, 0.6, 0.8]), _run("trl", 0, 80.0, [0.2, 0.5, 0.92])]
    rows = {r["name"]: r for r in rows_from(runs)["rows"]}
    assert rows["peer/relay-torch/fp32/wall_to_pass_0.9"]["skipped"].startswith("pass@1 0.9 not reached")
    short = _run("trl", 1, 80.0, [0.2, 0.5, 0.9])
    short["steps"] = short["steps"][:3]
    with pytest.raises(ValueError, match="different step counts"):
        rows_from(runs + [short])
