"""The publication pipeline's pure parts (learner/publish.py): the sharded safetensors writer that hashes
what it writes, the snapshot in the publication dtype, and the background publisher's ordering,
skip-to-the-newest back-pressure and drain. No Redis: the publisher's write step is replaced by one
that records what it was given (the real one is exercised by tests/integration/test_publish_pipeline.py)."""

import hashlib
import json
import threading

import pytest
import torch
from safetensors.torch import load_file

from broker.protocol import tensordigest
from broker.protocol import weightstore as ws
from learner.publish import (
    BackgroundPublisher,
    NonFiniteWeights,
    Progress,
    SnapshotFailed,
    fill,
    publication_dtype,
    snapshot,
    snapshot_buffers,
    write_safetensors,
)
from tests.support.models import needs_gpu


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(64, 32, generator=g) for i in range(5)} | {
        "embed.weight": torch.randn(100, 32, generator=g),
        "norm.bias": torch.zeros(32),
        "step": torch.tensor(3),
    }


@pytest.mark.parametrize("threads", [1, 3])  # shards written one after another, or side by side
def test_sharded_writer_hashes_what_it_writes_and_writes_the_hf_index(tmp_path, threads):
    state = snapshot(_state(), 1, torch.bfloat16)
    digests = write_safetensors(tmp_path, state, shard_bytes=8 * 1024, threads=threads)  # 64x32 bf16 = 4 KiB per layer
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(digests) == set(shards)
    for name, d in digests.items():  # the sha256 given to the manifest is that of the file on disk
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == d
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    back = {}
    for name in shards:
        part = load_file(tmp_path / name)
        assert all(index["weight_map"][k] == name for k in part)
        back.update(part)
    assert set(back) == set(state)
    for k, t in state.items():  # a bf16 round trip, bit for bit
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    assert back["layers.0.weight"].dtype == torch.bfloat16 and back["step"].dtype == torch.int64


def test_a_small_state_is_one_file_sealed_with_the_writers_digests(tmp_path):
    staging = ws.staging_dir(tmp_path, 4)
    state = snapshot(_state(), 4)
    known = write_safetensors(staging, state, shard_bytes=1 << 30)
    (staging / "config.json").write_text("{}")
    assert list(known) == ["model.safetensors"] and not (staging / "model.safetensors.index.json").exists()
    path, h = ws.seal(tmp_path, 4, staging, known)
    checked = ws.check(path, h, tmp_path, expected_digest=tensordigest.state_digest(state))
    assert checked.manifest["files"]["model.safetensors"] == known["model.safetensors"]
    assert checked.digest == tensordigest.state_digest(state)


def test_snapshot_is_a_copy_in_the_publication_dtype_without_the_tied_head():
    live = _state() | {"lm_head.weight": torch.ones(100, 32)}
    snap = snapshot(live, 1, torch.bfloat16, tied=True)
    assert "lm_head.weight" not in snap and snap["embed.weight"].dtype == torch.bfloat16
    assert snap["step"].dtype == torch.int64  # integers keep their dtype
    live["embed.weight"].add_(1.0)  # training goes on: the snapshot does not move
    assert not torch.equal(snap["embed.weight"].float(), live["embed.weight"].bfloat16().float())
    assert publication_dtype("auto", bf16=True) == torch.bfloat16
    assert publication_dtype("auto", bf16=False) == torch.float32
    assert publication_dtype("float32", bf16=True) == torch.float32
    with pytest.raises(NonFiniteWeights, match="version 7.*layers.2.weight"):
        bad = _state()
        bad["layers.2.weight"][3, 4] = float("inf")
        snapshot(bad, 7)
    big = {"w": torch.full((4,), 3e38)}  # a sum that overflows, of finite weights: published
    assert snapshot(big, 1)["w"].shape == (4,)
    for dtype in (torch.bfloat16, torch.float16):  # summed in bf16 / in float32: finite weights pass, in any dtype
        assert snapshot({"w": torch.full((8,), 3e38 if dtype == torch.bfloat16 else 6e4)}, 1, dtype)["w"].dtype == dtype
        for poison in (float("nan"), float("-inf")):
            w = torch.ones(5, 7)
            w[2, 3] = poison
            with pytest.raises(NonFiniteWeights):
                snapshot({"w": w}, 2, dtype)


class GatedWriter:
    """Stands for Publisher.write: records each version it writes; waits for ``gate`` before each."""

    def __init__(self):
        self.written, self.gate, self.started = [], threading.Event(), threading.Event()

    def write(self, config, state, version, progress=None):
        self.started.set()
        assert self.gate.wait(10)
        if state.get("fail") is not None:
            raise OSError("disk full")
        self.written.append(version)
        return version


def test_background_publisher_keeps_order_and_skips_to_the_newest():
    w = GatedWriter()
    bg = BackgroundPublisher(w, config=None)
    bg.submit(1, {})
    assert w.started.wait(10)  # version 1 is being written
    bg.submit(2, {})  # waits
    bg.submit(3, {})  # replaces 2: skipped
    bg.submit(4, {})  # replaces 3: skipped
    assert bg.take_skipped() == 2 and bg.take_skipped() == 0
    with pytest.raises(TimeoutError):
        bg.drain(timeout=0.2)
    w.gate.set()
    bg.drain(timeout=10)
    assert w.written == [1, 4] and bg.announced == 4
    bg.submit(5, {})
    bg.close()  # drains first
    assert w.written == [1, 4, 5]


def test_a_failed_publication_is_raised_in_the_learner():
    w = GatedWriter()
    w.gate.set()
    bg = BackgroundPublisher(w, config=None)
    bg.submit(1, {"fail": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="publishing weights failed: disk full"):
        bg.drain(timeout=10)
    with pytest.raises(RuntimeError, match="disk full"):
        bg.submit(2, {})


def test_a_snapshot_done_with_is_reused_for_the_next():
    w = GatedWriter()
    w.gate.set()
    bg = BackgroundPublisher(w, config=None)
    first = snapshot(_state(1), 1, torch.bfloat16)
    bg.submit(1, first)
    bg.drain(timeout=10)
    spare = bg.spare()
    assert spare is first and bg.spare() is None
    ptr = spare["embed.weight"].data_ptr()
    second = snapshot(_state(2), 2, torch.bfloat16, into=spare)
    assert second["embed.weight"].data_ptr() == ptr  # the same buffer, new values
    assert torch.equal(second["embed.weight"], _state(2)["embed.weight"].bfloat16())
    bg.close()


def test_a_nonfinite_snapshot_is_refused_by_the_publisher_thread_which_goes_on(tmp_path):
    """snapshot(check=False) leaves the check to the publisher's thread: a NaN version is refused (nothing
    written, counted by take_refused), and the next version is published as usual."""
    written = []

    class Writer:
        dtype = torch.float32

        def write(self, config, state, version, progress=None):
            from learner.publish import refuse_nonfinite

            refuse_nonfinite(state, version)
            written.append(version)

    bg = BackgroundPublisher(Writer(), config=None)
    bad = snapshot({"w": torch.tensor([1.0, float("nan")])}, 1, check=False)  # the learner does not wait for the check
    bg.submit(1, bad)
    bg.drain()
    assert bg.take_refused() == 1 and written == [] and bg.spare() is bad
    bg.submit(2, snapshot({"w": torch.tensor([1.0, 2.0])}, 2, check=False))
    bg.close()
    assert written == [2] and bg.take_refused() == 0


def test_a_snapshot_handed_over_before_it_is_filled_is_written_after_its_copy():
    """The learner hands its snapshot over first and copies into it after (the collective broadcast
    streams it); the writer sees it filled, in the buffers' order; a copy that fails reaches the writer
    as SnapshotFailed, and the learner gets its own error."""
    live = _state(3)
    order = list(reversed(live))  # the broadcast's order, here the reverse of the model's
    into = {
        k: torch.empty(live[k].shape, dtype=torch.bfloat16 if live[k].is_floating_point() else live[k].dtype)
        for k in order
    }
    bufs = snapshot_buffers(live, torch.bfloat16, into=into)
    assert list(bufs) == order and all(bufs[k] is into[k] for k in order)

    seen = {}

    class Writer:
        def write(self, config, state, version, progress=None):
            progress.wait(order[:1])  # the first tensor is there before the rest
            seen[version] = progress.wait() or {k: v.clone() for k, v in state.items()}

    bg = BackgroundPublisher(Writer(), config=None)
    progress = Progress()
    bg.submit(1, bufs, progress)
    fill(bufs, live, progress)
    bg.drain(timeout=10)
    assert list(seen[1]) == order
    assert all(torch.equal(seen[1][k], live[k].to(seen[1][k].dtype)) for k in order)

    broken, bufs2 = Progress(), snapshot_buffers(live, torch.bfloat16)
    bg.submit(2, bufs2, broken)
    with pytest.raises(KeyError):
        fill(bufs2, {k: v for k, v in live.items() if k != "norm.bias"}, broken)
    with pytest.raises(RuntimeError, match="publishing weights failed: the snapshot's copy failed"):
        bg.drain(timeout=10)
    with pytest.raises(SnapshotFailed):
        broken.wait()


def test_a_snapshot_of_gpu_weights_lands_in_one_pinned_block_with_every_tensor_reported():
    """Weights on a GPU: fresh buffers are views of one page-locked block (full-speed device-to-host
    copies, queued together), filled with the weights in the publication dtype, each reported filled."""
    live = {k: v.cuda() for k, v in _state(4).items()}
    bufs = snapshot_buffers(live, torch.bfloat16)
    assert all(b.device.type == "cpu" and b.is_pinned() for b in bufs.values())
    assert len({b.untyped_storage().data_ptr() for b in bufs.values()}) == 1
    assert all(b.data_ptr() % 64 == 0 for b in bufs.values())
    progress = Progress()
    fill(bufs, live, progress)
    progress.wait()
    assert all(torch.equal(bufs[k], live[k].cpu().to(bufs[k].dtype)) for k in live)
    again = snapshot_buffers(live, torch.bfloat16, into=bufs)  # reused, not allocated again
    assert all(again[k] is bufs[k] for k in live)


for _mark in needs_gpu():  # marked gpu, skipped (saying why) where torch sees no GPU
    test_a_snapshot_of_gpu_weights_lands_in_one_pinned_block_with_every_tensor_reported = _mark(
        test_a_snapshot_of_gpu_weights_lands_in_one_pinned_block_with_every_tensor_reported
    )
