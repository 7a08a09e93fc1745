"""Checkpoint and resume with sequence parallelism: a real learner (learner/trainer.py, real DeepSpeed ZeRO 2 in
fp32, a real Redis; tests/support/learner_sp_resume.py) on 2 gloo ranks in one sequence-parallel group
(learner.compute.sequence_parallel = 2) trains 2 steps, checkpoints and ends; a new pair of processes resumes from
the checkpoint and trains step 3. The resumed ranks hold the weights and the optimizer partitions the stopped
ones saved, bit for bit, and step 3 gives the weights, optimizer state and metrics of a run that trained its 3
steps without stopping, to 1e-5. What only the world's rank 0 does, it alone did: one metrics line per step, one
announcement and one stored copy per version, one checkpoint with each rank's optimizer part."""

import json

import pytest
import redis
import torch
from safetensors.torch import load_file

from benchmarks.learner import make_groups
from broker.client import queues
from broker.protocol import weightstore
from broker.protocol.group import encode_group
from broker.protocol.keys import Keys
from tests.support.ranks import run_module

TOL = 1e-5
RANKS = 2


def _feed(redis_url: str, run_id: str) -> None:
    """The same 6 batches of 4 groups (more than 3 steps need) into ``run_id``'s stream."""
    r, keys = redis.Redis.from_url(redis_url), Keys(run_id)
    queues.ensure_groups(r, keys)
    groups = [g for g in make_groups(24, 4, 10, seed=5)]
    for g in groups:
        g.run_id = run_id
    pipe = r.pipeline()
    queues.append_groups(pipe, keys, 100, 1 << 30, [(g, encode_group(g)) for g in groups])
    pipe.execute()


def _learner(redis_url, run_dir, run_id, steps, tag) -> str:
    return run_module(["tests.support.learner_sp_resume", redis_url, run_dir, run_id, steps, tag], ranks=RANKS)


def _state(run_dir, name: str) -> tuple[dict, dict]:
    return json.loads((run_dir / f"{name}.json").read_text()), load_file(str(run_dir / f"{name}.safetensors"))


def _close(got: dict, want: dict, what) -> None:
    assert got.keys() == want.keys(), what
    for k, w in want.items():
        if w.is_floating_point():
            scale = max(1.0, float(w.abs().max()))
            assert torch.allclose(got[k], w, rtol=TOL, atol=TOL * scale), (what, k, float((got[k] - w).abs().max()))
        else:
            assert torch.equal(got[k], w), (what, k)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _announced(redis_url, run_id) -> list[int]:
    r, keys = redis.Redis.from_url(redis_url), Keys(run_id)
    return [json.loads(f[b"data"])["version"] for _, f in r.xrange(keys.events) if f[b"kind"] == b"published"]


@pytest.mark.slow  # three learners of 2 ranks with DeepSpeed ZeRO 2: left to `make test` (docs/testing.md)
def test_a_sequence_parallel_learner_resumes_from_its_checkpoint_as_if_not_stopped(redis_url, tmp_path):
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    for run_id in ("stopped", "straight"):
        _feed(redis_url, run_id)
    _learner(redis_url, stopped, "stopped", 2, "first")  # 2 steps, a checkpoint at step 2, the end
    log = _learner(redis_url, stopped, "stopped", 3, "resumed")  # resumes at step 2, trains step 3
    assert "resumed from checkpoint at step 2" in log
    _learner(redis_url, straight, "straight", 3, "straight")  # the same 3 steps without stopping

    ckpt = stopped / "checkpoints"
    assert (ckpt / "latest").read_text() == "step-000003"
    for step in (2, 3):  # one folder per checkpoint: the leader's state and weights, each rank's optimizer part
        files = sorted(p.name for p in (ckpt / f"step-{step:06d}").iterdir())
        parts = [f"rank-{r:05d}.{ext}" for r in range(RANKS) for ext in ("json", "safetensors")]
        assert files == sorted(parts + ["model.safetensors", "state.json"]), files
    held = json.loads((ckpt / "step-000003" / "state.json").read_text())
    assert (held["ranks"], held["zero_stage"], held["bf16"]) == (RANKS, 2, False)

    for r in range(RANKS):
        saved_meta, saved = _state(stopped, f"first-end-{r}")
        loaded_meta, loaded = _state(stopped, f"resumed-start-{r}")
        assert (saved_meta["step"], loaded_meta["step"]) == (2, 2)
        assert saved_meta["optimizer"] == loaded_meta["optimizer"], r  # this rank's ZeRO partition, its layout
        assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved), r
        assert any(k.startswith("o.") for k in saved) and any(k.startswith("w.") for k in saved)
        # the resumed step 3 is the uninterrupted run's step 3
        resumed_meta, resumed = _state(stopped, f"resumed-end-{r}")
        want_meta, want = _state(straight, f"straight-end-{r}")
        assert resumed_meta["step"] == want_meta["step"] == 3
        assert resumed_meta["optimizer"] == want_meta["optimizer"]
        _close(resumed, want, ("rank", r))
        assert any(not torch.equal(resumed[k], saved[k]) for k in saved if k.startswith("w."))  # step 3 moved them
    # both ranks of the sequence group hold the same weights after every step (rank checksums)
    sums = [[json.loads(x) for x in (stopped / f"rank-{r}.checksums").read_text().splitlines()] for r in range(RANKS)]
    assert [c["step"] for c in sums[0]] == [1, 2, 3] and [a["sha256"] for a in sums[0]] == [
        b["sha256"] for b in sums[1]
    ]

    # what the world's rank 0 alone writes: one metrics line per step (none twice across the restart), one
    # announcement and one stored copy of each version, the published step 3 that of the uninterrupted run
    got, want = _metrics(stopped), _metrics(straight)
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3]
    for key in ("loss", "entropy", "reward_mean", "grad_norm", "version"):
        w = want[2][key]
        assert got[2][key] == (w if w is None else pytest.approx(w, rel=TOL, abs=1e-7)), key
    assert _announced(redis_url, "stopped") == _announced(redis_url, "straight") == [0, 1, 2, 3]
    store = stopped / "weights"
    assert weightstore.list_versions(store) == [0, 1, 2, 3]
    published = load_file(str(weightstore.version_dir(store, 3) / "model.safetensors"))
    other = load_file(str(weightstore.version_dir(straight / "weights", 3) / "model.safetensors"))
    _close(published, other, "published version 3")
