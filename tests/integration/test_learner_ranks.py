"""`relay up --learner-ranks 2`: two DeepSpeed processes (started by deploy/launcher/ranks.py, gloo on CPU), each training on
its own half of every batch, hold identical weights after every step; with ZeRO-3, where each holds
a partition of the weights, they publish the whole model and checkpoint their partitions."""

import json

import pytest
from safetensors.torch import load_file

from broker.protocol import weightstore
from tests.support.services import relay, relay_up_args


@pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)
def test_two_learner_ranks_stay_identical(tmp_path):
    steps = 8
    res = relay(
        *relay_up_args(
            tmp_path,
            "r2",
            "--learner-ranks",
            "2",
            steps=steps,
            sets=(
                "learner.metrics.rank_checksums=true",
                "learner.batch.groups=8",
            ),
        ),
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = tmp_path / "r2"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["groups_trained"] == steps * 8
    assert summary["audit"]["trained_once"] == steps * 8 and summary["audit"]["lost"] == 0
    sums = [[json.loads(x) for x in (run / "learner" / f"rank-{r}.checksums").read_text().splitlines()] for r in (0, 1)]
    assert [c["step"] for c in sums[0]] == [c["step"] for c in sums[1]] == list(range(1, steps + 1))
    for a, b in zip(*sums):
        assert a["sha256"] == b["sha256"], f"ranks diverged at step {a['step']}"
    assert len({c["sha256"] for c in sums[0]}) == steps  # and the weights did change every step
    assert "on 2 rank(s)" in (run / "logs" / "learner.log").read_text()


def test_batch_must_split_evenly_across_ranks(tmp_path):
    res = relay("up", "--learner-ranks", "3", "--runs-dir", str(tmp_path), "--dashboard-port", "0")
    assert res.returncode == 2 and "multiple of --learner-ranks" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_two_learner_ranks_zero3_bf16_publish_the_whole_model_and_checkpoint(tmp_path):
    steps = 4
    res = relay(
        *relay_up_args(
            tmp_path,
            "z3",
            "--learner-ranks",
            "2",
            steps=steps,
            sets=(
                "learner.batch.groups=8",
                "learner.deepspeed.zero_stage=3",
                "learner.deepspeed.bf16=true",
                "learner.publish.checkpoint_every=2",
                "learner.deepspeed.zero3_persistence_threshold=0",
            ),
        ),
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = tmp_path / "z3"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["audit"]["trained_once"] == steps * 8 and summary["audit"]["lost"] == 0
    # every published version is the whole model, gathered from both ranks' partitions (the threshold 0
    # partitions every weight, so publishing hangs or comes out empty unless both ranks take part)
    base = load_file(str(run / "learner" / "base_model" / "model.safetensors"))
    store = run / "weights"
    versions = weightstore.list_versions(store)
    assert versions[-1] == steps
    first, last = (
        load_file(str(weightstore.version_dir(store, v) / "model.safetensors")) for v in (versions[0], steps)
    )
    assert {k: v.shape for k, v in last.items()} == {k: v.shape for k, v in base.items()}
    assert all(not v.eq(0).all() for v in last.values())
    assert any(not first[k].equal(last[k]) for k in base)  # trained
    # the last checkpoint holds each rank's partition, written with the run's engine settings
    ckpt = run / "learner" / "checkpoints" / "step-000004"
    assert (run / "learner" / "checkpoints" / "latest").read_text() == ckpt.name
    state = json.loads((ckpt / "state.json").read_text())
    assert (state["ranks"], state["zero_stage"], state["bf16"]) == (2, 3, True)
    assert {p.name for p in ckpt.iterdir()} == {
        "state.json",
        "rank-00000.json",
        "rank-00000.safetensors",
        "rank-00001.json",
        "rank-00001.safetensors",
    }
