"""The tensor digest: the same tensors give the same digest however they are split or ordered; any
changed byte, name, dtype or shape changes it."""

import hashlib

import pytest
import torch

from broker.protocol.tensordigest import ALGORITHMS, algorithm_of, combine, state_digest, torch_entry
from tests.support.models import needs_gpu


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(4, 3, generator=g),
        "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "scale": torch.tensor(2.0),
    }


def test_order_and_split_do_not_matter():
    s = _state()
    d = state_digest(s)
    assert d == combine(reversed([torch_entry(k, v) for k, v in s.items()]))
    assert d == state_digest(dict(reversed(list(s.items()))))


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("change", ["byte", "name", "dtype", "shape", "missing"])
def test_any_change_is_seen(change, algo):
    s = _state()
    d = state_digest(s, algo)
    t = dict(s)
    if change == "byte":
        raw = t["b.bias"].clone()
        raw.view(torch.int16)[2] ^= 1  # one bit of one bf16 value
        t["b.bias"] = raw
    elif change == "name":
        t["c.bias"] = t.pop("b.bias")
    elif change == "dtype":
        t["a.weight"] = t["a.weight"].double()
    elif change == "shape":
        t["a.weight"] = t["a.weight"].reshape(3, 4)
    else:
        del t["scale"]
    assert state_digest(t, algo) != d


def test_duplicate_names_are_an_error():
    e = torch_entry("x", torch.zeros(2))
    with pytest.raises(ValueError):
        combine([e, e])


def test_a_digest_names_its_algorithm_and_sha256_keeps_the_first_definition():
    """xxh3 digests read ``xxh3:<hex>`` (the default); sha256 ones are the plain hex announced before
    xxh3 existed, computed exactly as then: sha256 over the context and each tensor's (name, dtype, shape,
    sha256 of its bytes) in name order, so stored versions and old announcements still check."""
    s = _state()
    fast, strong = state_digest(s), state_digest(s, "sha256")
    assert fast.startswith("xxh3:") and len(fast) == 5 + 64 and algorithm_of(fast) == "xxh3"
    assert len(strong) == 64 and algorithm_of(strong) == "sha256"

    def ns(b: bytes) -> bytes:
        return str(len(b)).encode() + b":" + b + b","

    h = hashlib.sha256(ns(b"relay-tensors-v1"))
    for k in sorted(s):
        t = s[k]
        h.update(
            ns(k.encode())
            + ns(str(t.dtype).removeprefix("torch.").encode())
            + ns(",".join(map(str, t.shape)).encode())
            + hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).digest()
        )
    assert strong == h.hexdigest()
    with pytest.raises(ValueError, match="unknown tensor digest algorithm"):
        state_digest(s, "md5")


def _awkward_state(device="cpu"):
    """Tensors that cross chunk boundaries, a strided one, bf16, a scalar and an empty one."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(37, 11, generator=g)
    return {
        k: v.to(device)
        for k, v in {
            "big": big,
            "strided": big.t(),
            "half": torch.randn(9, generator=g).bfloat16(),
            "scale": torch.tensor(3.0),
            "empty": torch.empty(0, 4),
        }.items()
    }


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_chunked_pipeline_gives_the_digest_of_the_whole_tensors(algo, chunk, threads):
    """Chunks through a ring of buffers, hashed by several threads (each tensor's chunks by one, in order)."""
    from broker.protocol.tensordigest import device_entries

    s = _awkward_state()
    assert combine(device_entries(s, algo, chunk_bytes=chunk, threads=threads), algo) == state_digest(s, algo)
    changed = dict(s, big=s["big"].clone())
    changed["big"][36, 10] += 1  # the last byte of the last chunk
    assert combine(device_entries(changed, algo, chunk_bytes=chunk, threads=threads), algo) != state_digest(s, algo)


def test_tensors_on_a_gpu_have_the_digest_of_their_cpu_copies():
    s = _awkward_state()
    assert state_digest(_awkward_state("cuda")) == state_digest(s)
    assert state_digest({k: v.to("cuda") for k, v in _awkward_state().items()}, "sha256") == state_digest(s, "sha256")


for _mark in needs_gpu():  # marked gpu, skipped (saying why) where torch sees no GPU
    test_tensors_on_a_gpu_have_the_digest_of_their_cpu_copies = _mark(
        test_tensors_on_a_gpu_have_the_digest_of_their_cpu_copies
    )
