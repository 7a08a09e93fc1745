"""The digest of a set of named tensors: what a weight version *is*, however it travels.

A version's manifest hash (weightstore.py) identifies its files; this digest identifies its tensors,
so that a generator can check what it applied whether the bytes came from the store, over HTTP or
through a collective broadcast (docs/weights.md). Announcements carry it (``Announcement.digest``).

    digest = sha256( netstring(context),
                     then for each tensor, in name order:
                         netstring(name) netstring(dtype) netstring(shape) H(raw bytes) )

``H`` is the per-tensor hash, one of :data:`ALGORITHMS` (``weights.digest``):

- ``xxh3`` (the default): XXH3-128 of the bytes, 16 bytes; context ``relay-tensors-v2-xxh3``; the digest
  is written ``xxh3:<64 hex digits>``. About 5x faster than SHA-256 on one core (8 vs 1.4 GB/s here),
  which is what makes a check of every byte affordable on every generator (a 7B model in bf16 is
  15 GB). Not cryptographic: it proves what was applied is what was published against corruption
  and bugs; against tampering the files are covered by their SHA-256 (the signed manifest) and the
  collective by its network (docs/weights.md, "What the digest proves").
- ``sha256``: SHA-256 of the bytes, 32 bytes; context ``relay-tensors-v1``; the digest is 64 hex
  digits (the format of every digest before ``xxh3`` existed, still understood).

``dtype`` is torch's name without the ``torch.`` prefix (``bfloat16``, ``float32``), ``shape`` the
sizes joined by ``,`` (empty for a scalar), the raw bytes the tensor's little-endian, C-contiguous
memory. Each tensor's hash can be computed apart (a receiver hashes buckets as they land, in any
order); the combination fixes the order. A digest names its algorithm (:func:`algorithm_of`), so a
checker always computes the one it is compared with. Only the function that takes torch tensors imports torch.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import xxhash

ALGORITHMS = ("xxh3", "sha256")
DEFAULT = "xxh3"
CONTEXTS = {"sha256": b"relay-tensors-v1", "xxh3": b"relay-tensors-v2-xxh3"}
CONTEXT = CONTEXTS["sha256"]


def _netstring(b: bytes) -> bytes:
    return str(len(b)).encode() + b":" + b + b","


def algorithm_of(digest: str) -> str:
    """The per-tensor hash a digest was made with: ``xxh3`` for ``xxh3:...``, else ``sha256``."""
    return "xxh3" if digest.startswith("xxh3:") else "sha256"


def hasher(algorithm: str):
    """A fresh incremental hash object (``update``, ``digest``) for one tensor's bytes."""
    if algorithm == "xxh3":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown tensor digest algorithm {algorithm!r} (one of {', '.join(ALGORITHMS)})")


def tensor_entry(name: str, dtype: str, shape: Iterable[int], data, algorithm: str = DEFAULT) -> tuple[str, bytes]:
    """(name, the entry that goes into the digest) for one tensor; ``data`` is a bytes-like object."""
    h = hasher(algorithm)
    h.update(data)
    return tensor_entry_from_hash(name, dtype, shape, h.digest())


def tensor_entry_from_hash(name: str, dtype: str, shape: Iterable[int], tensor_hash: bytes) -> tuple[str, bytes]:
    """:func:`tensor_entry` when the hash of the tensor's bytes is already known (hashed as they streamed by)."""
    head = _netstring(name.encode()) + _netstring(dtype.encode()) + _netstring(",".join(map(str, shape)).encode())
    return name, head + tensor_hash


def combine(entries: Iterable[tuple[str, bytes]], algorithm: str = DEFAULT) -> str:
    """The digest of tensor entries (from :func:`tensor_entry` with the same ``algorithm``), whatever
    order they come in."""
    entries = sorted(entries)
    names = [n for n, _ in entries]
    if len(set(names)) != len(names):
        raise ValueError("a tensor name appears twice")
    hasher(algorithm)  # an unknown algorithm is an error here too
    h = hashlib.sha256(_netstring(CONTEXTS[algorithm]))
    for _, entry in entries:
        h.update(entry)
    return h.hexdigest() if algorithm == "sha256" else f"{algorithm}:{h.hexdigest()}"


def torch_entry(name: str, t, algorithm: str = DEFAULT) -> tuple[str, bytes]:
    """:func:`tensor_entry` of a torch tensor (copied to the CPU when it is elsewhere)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.numel() else b""
    return tensor_entry(name, str(t.dtype).removeprefix("torch."), t.shape, raw, algorithm)


def state_digest(state: dict, algorithm: str = DEFAULT) -> str:
    """The digest of a ``{name: torch tensor}`` mapping. Tensors on one CUDA device (a generator checking
    what it serves) are streamed to the host by :func:`device_entries`."""
    devices = {t.device for t in state.values()}
    if len(devices) == 1 and next(iter(devices)).type == "cuda":
        return combine(device_entries(state, algorithm), algorithm)
    return combine((torch_entry(k, v, algorithm) for k, v in state.items()), algorithm)


CHUNK_BYTES = 16 << 20
HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))  # XXH3 and sha256 release the GIL on large inputs


def device_entries(
    state: dict, algorithm: str = DEFAULT, chunk_bytes: int = CHUNK_BYTES, threads: int = HASH_THREADS
) -> list[tuple[str, bytes]]:
    """:func:`torch_entry` of each tensor of ``state``, all on one accelerator, with its bytes copied to
    the host in chunks through a ring of ``2 * threads`` pinned buffers and hashed by ``threads`` hashing
    threads: the copies of the next chunks (on a side stream) run while earlier ones are hashed, and the
    tensors are spread over the threads by size (each tensor's chunks are hashed in order by one
    thread), so the check costs about the slower of the copy and the largest thread's share rather than
    their sum. No tensor is copied whole to pageable memory (``.cpu()`` on each of a 0.5B model's 290
    tensors took 0.34 s on an H200, docs/benchmarks.md). Host memory: ``2 * threads`` chunks. The tensors
    must not change until it returns. Tensors on the CPU run the same pipeline, unpinned and with
    synchronous copies (how it is tested without a GPU)."""
    import torch

    device = next(iter(state.values())).device if state else torch.device("cpu")
    cuda = device.type == "cuda"
    threads = max(1, threads)
    pieces, flats, load = [], {}, [0] * threads
    owner = {}  # tensor -> the hashing thread that takes all its chunks (largest first, to the least loaded)
    for name, t in sorted(state.items(), key=lambda kv: -kv[1].numel() * kv[1].element_size()):
        owner[name] = load.index(min(load))
        load[owner[name]] += t.numel() * t.element_size()
    for name, t in state.items():
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        flats[name] = flat  # contiguous copies of strided tensors stay alive until copied
        pieces += [(name, s, min(chunk_bytes, flat.numel() - s)) for s in range(0, flat.numel(), chunk_bytes)]
    size = max((n for _, _, n in pieces), default=0)  # a small state pins no more than it needs
    bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(2 * threads)]
    stream = torch.cuda.Stream(device) if cuda else None
    if cuda:
        stream.wait_stream(torch.cuda.current_stream(device))  # the tensors as they are now
    hashes = {name: hasher(algorithm) for name in state}

    def hash_piece(done, name: str, buf: torch.Tensor) -> None:
        if done is not None:
            done.synchronize()
        hashes[name].update(buf.numpy())

    pools = [ThreadPoolExecutor(1, thread_name_prefix="relay-digest") for _ in range(threads)]
    in_use: list = [None] * len(bufs)  # the hash reading each buffer
    try:
        for i, (name, s, n) in enumerate(pieces):
            j = i % len(bufs)
            if in_use[j] is not None:
                in_use[j].result()  # hashed: the buffer takes the next chunk
            buf, done = bufs[j][:n], None
            if cuda:
                with torch.cuda.stream(stream):
                    buf.copy_(flats[name][s : s + n], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
            else:
                buf.copy_(flats[name][s : s + n])
            in_use[j] = pools[owner[name]].submit(hash_piece, done, name, buf)
        for f in in_use:
            if f is not None:
                f.result()
    finally:
        for pool in pools:
            pool.shutdown(wait=True)
    return [
        tensor_entry_from_hash(name, str(t.dtype).removeprefix("torch."), t.shape, hashes[name].digest())
        for name, t in state.items()
    ]
