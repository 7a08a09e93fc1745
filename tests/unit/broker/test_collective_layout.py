"""The collective transport's wire layout (broker/protocol/collective.py): pure logic, no network."""

import hashlib
import json

import pytest

from broker.protocol import collective as wire
from broker.protocol import signing
from broker.protocol.tensordigest import combine, tensor_entry

TENSORS = [
    ("b.weight", "bfloat16", (3, 5)),
    ("a.bias", "float32", (7,)),
    ("c.scale", "float32", ()),
    ("d.empty", "float32", (0, 4)),
    ("e.big", "float32", (100,)),
]


def test_tensors_lie_in_name_order_at_aligned_offsets_without_overlap():
    layout = wire.plan(TENSORS, 64)
    assert [s.name for s in layout.slots] == ["a.bias", "b.weight", "c.scale", "d.empty", "e.big"]
    assert [s.nbytes for s in layout.slots] == [28, 30, 4, 0, 400]
    assert all(s.offset % wire.ALIGN == 0 for s in layout.slots)
    ends = [s.offset + s.nbytes for s in layout.slots]
    assert all(e <= s.offset for e, s in zip(ends, layout.slots[1:]))
    assert layout.total == ends[-1] == 192 + 400


def test_buckets_cover_the_buffer_once_and_every_tensor_completes_in_exactly_one_bucket():
    for size in (64, 100, 256, 4096):
        layout = wire.plan(TENSORS, size)
        buckets = layout.buckets
        assert buckets[0][0] == 0 and buckets[-1][1] == layout.total
        assert all(a[1] == b[0] for a, b in zip(buckets, buckets[1:]))
        assert all(e - s == size for s, e in buckets[:-1]) and 0 < buckets[-1][1] - buckets[-1][0] <= size
        done = [s.name for start, end in buckets for s in layout.completed_by(start, end)]
        assert sorted(done) == sorted(n for n, _, _ in TENSORS)
        for start, end in buckets:  # a tensor is complete only once its last byte landed
            assert all(s.offset + s.nbytes <= end for s in layout.completed_by(start, end))


def test_a_header_parses_back_to_the_same_layout_and_a_tampered_one_is_refused():
    layout = wire.plan(TENSORS, 128)
    version, back = wire.parse_header(layout.header(7), 1 << 20)
    assert version == 7 and back == layout
    h = json.loads(layout.header(7))
    h["tensors"][1][3] += 64  # an offset that is not the canonical one (it would overlap or leave holes)
    with pytest.raises(wire.CollectiveError, match="canonical"):
        wire.parse_header(json.dumps(h).encode(), 1 << 20)
    with pytest.raises(wire.CollectiveError, match="at most"):
        wire.parse_header(layout.header(7), 100)  # more bytes than the receiver accepts
    with pytest.raises(wire.CollectiveError, match="malformed"):
        wire.parse_header(b"[1, 2]", 1 << 20)
    with pytest.raises(ValueError, match="dtype"):
        wire.plan([("x", "complex64", (2,))], 64)


def test_the_digest_of_the_flat_buffer_is_the_digest_of_the_tensors():
    """What both sides hash (each tensor's parts, bucket by bucket, into its own incremental hash) is what
    tensordigest.py defines for the tensors, whatever the buckets cut and however many hashing threads."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from broker.protocol.tensordigest import ALGORITHMS, state_digest

    state = {
        "w": torch.arange(40, dtype=torch.float32).reshape(10, 4),
        "v": torch.ones(5, dtype=torch.bfloat16),
        "e": torch.zeros(0),
        "z": torch.arange(3, dtype=torch.int64),
    }
    pools = [ThreadPoolExecutor(1) for _ in range(3)]

    def digest(flat, layout):
        hashes = wire.BucketHasher(layout, flat, pools)
        for start, end in layout.buckets or [(0, 0)]:
            hashes.add(start, end)
        return combine(hashes.entries(), layout.digest)

    for algo in ALGORITHMS:
        for bucket in (64, 128, 1 << 20):  # tensors cut across buckets, and all in one
            layout = wire.plan(
                [(k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in state.items()], bucket, algo
            )
            flat = torch.zeros(layout.total, dtype=torch.uint8)
            for s in layout.slots:
                flat[s.offset : s.offset + s.nbytes] = state[s.name].reshape(-1).view(torch.uint8)
            assert digest(flat, layout) == state_digest(state, algo)
            flat[100] ^= 1  # inside "w", which 64-byte buckets cut
            assert digest(flat, layout) != state_digest(state, algo)
    assert tensor_entry("w", "float32", (3, 4), b"")[0] == "w"


def test_the_trailer_signature_binds_version_digest_and_header():
    key, other = signing.AnnounceSigner.generate(), signing.AnnounceSigner.generate()  # the learner's, another's
    hs = hashlib.sha256(b"header").hexdigest()
    sig = signing.collective_signature(key, "run", 3, "d" * 64, hs)
    key = signing.AnnounceVerifier(key.public)  # what the generators check it with
    assert signing.check_collective(key, "run", 3, "d" * 64, hs, sig) is None
    assert signing.check_collective(key, "run", 4, "d" * 64, hs, sig) == "bad_signature"
    assert signing.check_collective(key, "run", 3, "e" * 64, hs, sig) == "bad_signature"
    assert signing.check_collective(key, "other-run", 3, "d" * 64, hs, sig) == "bad_signature"
    assert signing.check_collective(other, "run", 3, "d" * 64, hs, sig) == "bad_signature"
    assert (
        signing.check_collective(
            key, "run", 3, "d" * 64, hs, signing.collective_signature(other, "run", 3, "d" * 64, hs)
        )
        == "bad_signature"
    )
    assert signing.check_collective(key, "run", 3, "d" * 64, hs, "") == "unsigned"
    # not interchangeable with an announcement's signature (its own context string)
    assert signing.COLLECTIVE_CONTEXT != signing.CONTEXT
    assert (
        wire.parse_trailer(json.dumps({"version": 3, "digest": "d", "header_sha256": hs, "sig": sig}).encode())["sig"]
        == sig
    )
    with pytest.raises(wire.CollectiveError):
        wire.parse_trailer(b"{}")
