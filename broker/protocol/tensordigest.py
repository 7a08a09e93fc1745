"""The digest of a set of named tensors: what a weight version *is*, however it travels.

A version's manifest hash (weightstore.py) identifies its files; this digest identifies its tensors,
so that a generator can check what it applied whether the bytes came from the store, over HTTP or
through a collective broadcast (docs/weights.md). Announcements carry it (``Announcement.digest``).

    digest = sha256( "relay-tensors-v1" netstring,
                     then for each tensor, in name order:
                         netstring(name) netstring(dtype) netstring(shape) sha256(raw bytes) )

``dtype`` is torch's name without the ``torch.`` prefix (``bfloat16``, ``float32``), ``shape`` the
sizes joined by ``,`` (empty for a scalar), the raw bytes the tensor's little-endian, C-contiguous
memory. Each tensor's own sha256 can be computed apart (a receiver hashes buckets as they land, in
any order); the combination fixes the order. Only the function that takes torch tensors imports torch.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

CONTEXT = b"relay-tensors-v1"


def _netstring(b: bytes) -> bytes:
    return str(len(b)).encode() + b":" + b + b","


def tensor_entry(name: str, dtype: str, shape: Iterable[int], data) -> tuple[str, bytes]:
    """(name, the entry that goes into the digest) for one tensor; ``data`` is a bytes-like object."""
    return tensor_entry_from_sha(name, dtype, shape, hashlib.sha256(data).digest())


def tensor_entry_from_sha(name: str, dtype: str, shape: Iterable[int], sha256: bytes) -> tuple[str, bytes]:
    """:func:`tensor_entry` when the sha256 of the tensor's bytes is already known (hashed as they streamed by)."""
    head = _netstring(name.encode()) + _netstring(dtype.encode()) + _netstring(",".join(map(str, shape)).encode())
    return name, head + sha256


def combine(entries: Iterable[tuple[str, bytes]]) -> str:
    """The hex digest of tensor entries (from :func:`tensor_entry`), whatever order they come in."""
    entries = sorted(entries)
    names = [n for n, _ in entries]
    if len(set(names)) != len(names):
        raise ValueError("a tensor name appears twice")
    h = hashlib.sha256(_netstring(CONTEXT))
    for _, entry in entries:
        h.update(entry)
    return h.hexdigest()


def torch_entry(name: str, t) -> tuple[str, bytes]:
    """:func:`tensor_entry` of a torch tensor (copied to the CPU when it is elsewhere)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.numel() else b""
    return tensor_entry(name, str(t.dtype).removeprefix("torch."), t.shape, raw)


def state_digest(state: dict) -> str:
    """The digest of a ``{name: torch tensor}`` mapping."""
    return combine(torch_entry(k, v) for k, v in state.items())
