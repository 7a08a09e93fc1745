"""Sequence parallelism with data parallelism (world = dp × sp, learner/sequence_parallel.py, learner/ranks.py):
one optimizer step of the real learner update with real DeepSpeed on 4 gloo ranks, two data-parallel groups of
2 sequence-parallel ranks each, gives the gradients and diagnostics of one rank, to 1e-5 in fp32, at ZeRO 0 and
at ZeRO 2 with activation checkpointing (tests/support/learner_grads.py runs the steps).

Four processes on this machine's 2 cores are slow, so the cases are a subset of learner_grads' CASES that covers
every aggregation mode and every policy loss once, and two minibatches with a rejecting correction (token_mis):
``SUBSET`` below. The critic's cases are out (no critic with sequence parallelism: LearnerConfig refuses it).

The ranks' places are checked too: ranks {0, 1} and {2, 3} share rows (sequence-parallel groups), {0, 2} and
{1, 3} are the data-parallel groups; the ranks of one sequence group train the same samples (its data-parallel
rank's groups: group i on data-parallel rank i mod 2), each its own slice of every packed row, and the two data-
parallel groups together train every sample once. At ZeRO 0 each rank's own accumulated gradient is read before
the optimizer step: neither rank of a group holds its group's gradient alone, each data-parallel group's is part
of the step's, and DeepSpeed's average over the 4 ranks (each loss scaled by the world) is one rank's gradient.
"""

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from tests.support.ranks import run_module
from tests.support.learner_grads import CASES

TOL = 1e-5
# (aggregation, policy loss): token-mean ppo, seq-mean-token-sum cispo, seq-mean-token-mean reinforce,
# seq-mean-token-sum-norm ppo, and seq-mean-token-mean cispo with token_mis over two minibatches
SUBSET = [0, 4, 8, 9, 13]
LABELS = {"dpsp": "48/0/sp2", "dpsp_zero2": "48/2/sp2+checkpointing"}
WORLD, SP = 4, 2


def _close(got: dict, want: dict, what) -> None:
    assert got.keys() == want.keys(), what
    for name, w in want.items():
        scale = max(1.0, float(w.abs().max()))
        assert torch.allclose(got[name], w, rtol=TOL, atol=TOL * scale), (
            what,
            name,
            float((got[name] - w).abs().max()),
        )


def _differs(a: dict, b: dict) -> bool:
    return any(float((a[n] - b[n]).abs().max()) > 1e-4 for n in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpsp")
    module = ["tests.support.learner_grads", "--cases", ",".join(map(str, SUBSET)), out]
    run_module([*module, "one=100000"])
    run_module([*module, *(f"{k}={v}" for k, v in LABELS.items())], ranks=WORLD)
    return out


def _one(out) -> tuple[list, dict]:
    diags = json.loads((out / "one.json").read_text())
    return diags, {i: load_file(str(out / f"one-{i}.safetensors")) for i in SUBSET}


def _assert_covers(labels=SUBSET):
    assert {CASES[i][0] for i in labels} == {c[0] for c in CASES}  # every aggregation mode
    assert {CASES[i][1] for i in labels} == {c[1] for c in CASES}  # every policy loss


@pytest.mark.slow  # 4 ranks with two DeepSpeed engines each, on 2 cores: left to `make test` (docs/testing.md)
def test_two_data_parallel_groups_of_two_sequence_ranks_equal_one_rank(runs):
    _assert_covers()
    want_diags, want_grads = _one(runs)
    for label in LABELS:
        diags = json.loads((runs / f"{label}.json").read_text())
        assert len(diags) == len(CASES) and [i for i, d in enumerate(diags) if d is not None] == SUBSET
        for i in SUBSET:
            want, got = want_diags[i], diags[i]
            _close(load_file(str(runs / f"{label}-{i}.safetensors")), want_grads[i], (label, CASES[i]))
            for key, value in want.items():
                if key in ("micro_batches", "padding_fraction", "grad_norm"):
                    continue
                exact = isinstance(value, dict) or value is None
                assert got[key] == (value if exact else pytest.approx(value, rel=TOL, abs=1e-6)), (label, i, key)
            assert got["micro_batches"] > want["micro_batches"], (label, i)  # really cut into micro-batches
    assert max(float(g.abs().max()) for g in want_grads[SUBSET[0]].values()) > 1e-3  # a real gradient


@pytest.mark.slow
def test_each_rank_holds_its_groups_rows_and_the_data_parallel_average_is_one_ranks_gradient(runs):
    _, want_grads = _one(runs)
    for label in LABELS:
        placed = [json.loads((runs / f"{label}-rank-{r}.json").read_text()) for r in range(WORLD)]
        for r, p in enumerate(placed):
            assert p["rank"] == r and (p["sp_rank"], p["dp_rank"], p["dp"]) == (r % SP, r // SP, WORLD // SP)
            assert p["sp_members"] == [r - r % SP + s for s in range(SP)]  # contiguous: {0, 1}, {2, 3}
            assert p["dp_members"] == list(range(r % SP, WORLD, SP))  # across the groups: {0, 2}, {1, 3}
        for i in SUBSET:
            seen = [p["cases"][str(i)] for p in placed]
            for r in range(WORLD):
                # the ranks of one sequence group train the same samples: those of its data-parallel rank's groups
                assert seen[r]["groups"] == seen[r - r % SP]["groups"] and seen[r]["groups"], (label, i, r)
                assert {g % (WORLD // SP) for g in seen[r]["groups"]} == {r // SP}, (label, i, r)
                # each its own slice of every packed row: rank s of the group columns s·n .. (s + 1)·n of ⌈N / 2⌉
                mine, first = seen[r]["slices"], seen[r - r % SP]["slices"]
                assert len(mine) == len(first) > 0 and all(
                    lo == (r % SP) * n and (n, N) == (n0, N0) and n == -(-N // SP)
                    for (lo, n, N), (_, n0, N0) in zip(mine, first)
                ), (label, i, r)
            # the two data-parallel groups together: every sample of the batch once (8 groups of 4 samples)
            assert Counter(seen[0]["groups"] + seen[SP]["groups"]) == {g: 4 for g in range(8)}, (label, i)

    # ZeRO 0: each rank's own gradient before DeepSpeed's reduction (its loss multiplied by the world, 4)
    for i in SUBSET:
        local = [load_file(str(runs / f"dpsp-rank-{r}-{i}.safetensors")) for r in range(WORLD)]
        assert _differs(local[0], local[1]) and _differs(local[2], local[3])  # each SP rank holds a part
        groups = [{n: sum(local[r][n] for r in range(d * SP, (d + 1) * SP)) / WORLD for n in local[0]} for d in (0, 1)]
        want = want_grads[i]
        assert _differs(groups[0], want) and _differs(groups[1], want)  # each data-parallel group: part of it
        _close({n: groups[0][n] + groups[1][n] for n in want}, want, ("dp average", CASES[i]))
