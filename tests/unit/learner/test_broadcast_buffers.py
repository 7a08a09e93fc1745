"""The collective's snapshot buffers (learner/broadcast.py): a snapshot taken into ``Broadcaster.buffers``
is recognised from its own tensors and sent as it lies (no copy); any other state is copied."""

from unittest.mock import MagicMock

import torch

from broker.protocol.weights_config import CollectiveTransport
from learner.broadcast import Broadcaster
from learner.publish import snapshot
from tests.support.models import needs_gpu


def test_a_snapshot_in_the_broadcast_buffer_is_sent_as_it_lies():
    b = Broadcaster(MagicMock(), MagicMock(), CollectiveTransport(bucket_mb=1 / 16), None, "xxh3")
    live = {"a.w": torch.randn(10, 7), "b.w": torch.randn(3), "c": torch.arange(5), "e": torch.zeros(0)}
    snap = snapshot(live, 1, torch.bfloat16, into=b.buffers(live, torch.bfloat16))
    layout = b._layout([(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in snap.items()])
    flat = b._lies_in_buffer(snap, layout)
    assert flat is not None and flat.numel() == layout.total
    for s in layout.slots:  # the flat buffer holds each tensor's bytes at its slot
        got = flat[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
        assert torch.equal(got, snap[s.name])
    assert b._lies_in_buffer({k: v.clone() for k, v in snap.items()}, layout) is None  # elsewhere: copied
    moved = dict(snap, **{"b.w": snap["b.w"].clone()})  # one tensor out of place: copied
    assert b._lies_in_buffer(moved, layout) is None


def test_weights_on_a_gpu_snapshot_into_a_pinned_broadcast_buffer_sent_as_it_lies():
    b = Broadcaster(MagicMock(), MagicMock(), CollectiveTransport(bucket_mb=1 / 16), None, "xxh3")
    live = {"a.w": torch.randn(10, 7).cuda(), "b.w": torch.randn(3).cuda(), "c": torch.arange(5).cuda()}
    snap = snapshot(live, 1, torch.bfloat16, into=b.buffers(live, torch.bfloat16))
    assert all(t.is_pinned() for t in snap.values())
    assert all(torch.equal(snap[k], live[k].cpu().to(snap[k].dtype)) for k in live)
    layout = b._layout([(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in snap.items()])
    assert b._lies_in_buffer(snap, layout) is not None


for _mark in needs_gpu():  # marked gpu, skipped (saying why) where torch sees no GPU
    test_weights_on_a_gpu_snapshot_into_a_pinned_broadcast_buffer_sent_as_it_lies = _mark(
        test_weights_on_a_gpu_snapshot_into_a_pinned_broadcast_buffer_sent_as_it_lies
    )
