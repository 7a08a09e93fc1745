"""Learner checkpoints through real DeepSpeed engines at every ZeRO stage, in bf16 and fp32, on one
rank and on two (torchrun, gloo): a run resumed from a checkpoint holds the same weights and optimizer
state as the run that wrote it, and its next step gives the same loss and the same weights, bit for
bit, as not stopping. The engines run in a child process (tests/support/checkpoint_roundtrip.py)."""

import json

import pytest

from tests.support.ranks import run_module

ALL = ["0:fp32", "0:bf16", "1:fp32", "1:bf16", "2:fp32", "2:bf16", "3:fp32", "3:bf16"]


def _roundtrip(tmp_path, settings, ranks=1) -> list[dict]:
    run_module(["tests.support.checkpoint_roundtrip", "--out", tmp_path, *settings], ranks=ranks)
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(ranks)]


def _check_resumed_as_if_not_stopped(results: dict, settings, ranks: int, rank: int) -> None:
    for s in settings:
        r = results[s]
        assert r["latest"] == "step-000002" and r["state"]["step"] == 2 and r["state"]["version"] == 7, s
        assert r["state"]["uncommitted"] == [["1-0", "g"]], s  # what was trained comes back with the weights
        parts = [
            f"rank-{i:05d}.{ext}"
            for i in range(ranks if not s.startswith("0:") else 1)
            for ext in ("json", "safetensors")
        ]
        assert r["files"] == sorted(parts + ["state.json"] + ([] if s.startswith("3:") else ["model.safetensors"])), s
        assert r["optimizer_equal_after_load"], f"{s} rank {rank}: optimizer state (partition) differs after load"
        assert r["loss_resumed"] == r["loss_continued"], s
        if rank == 0:  # the full weights, as published, live on rank 0
            assert r["published_numel"] == r["model_numel"], s  # the whole model, also when ZeRO-3 partitions it
            assert r["weights_equal_after_load"] and r["weights_equal_after_next_step"], s
            assert r["weights_changed_by_step"], s


@pytest.mark.slow  # eight real DeepSpeed engines (docs/testing.md)
def test_checkpoint_roundtrip_every_zero_stage_bf16_and_fp32(tmp_path):
    [results] = _roundtrip(tmp_path, ALL)
    _check_resumed_as_if_not_stopped(results, ALL, ranks=1, rank=0)
    assert (
        "was written with {'ranks': 1, 'zero_stage': 3, 'bf16': True}, this learner runs {'ranks': 1, "
        "'zero_stage': 1, 'bf16': True}" in results["mismatch_error"]
    )


@pytest.mark.slow
def test_checkpoint_roundtrip_two_ranks_zero2_and_zero3(tmp_path):
    settings = ["2:bf16", "3:bf16"]
    for rank, results in enumerate(_roundtrip(tmp_path, settings, ranks=2)):
        _check_resumed_as_if_not_stopped(results, settings, ranks=2, rank=rank)
