"""Data-parallel ranks: the leader's batch shared with every rank, and per-rank weight checksums."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgpack
import torch
import torch.distributed as dist

from broker.protocol.group import decode_group, encode_group


def share_batch(fresh, version: int, leader: bool, world: int) -> tuple[list | None, int]:
    """Every rank gets the leader's groups (None when stopping) and the leader's version. The groups
    travel as their msgpack wire bytes over a uint8 tensor broadcast: no pickle."""
    if world == 1:
        return (None if fresh is None else [g for _, g in fresh]), version
    payload = b""
    if leader and fresh is not None:
        payload = msgpack.packb([encode_group(g) for _, g in fresh], use_bin_type=True)
    header = torch.tensor([len(payload) if (not leader or fresh is not None) else -1, version])
    dist.broadcast(header, 0)
    n, version = int(header[0]), int(header[1])
    if n < 0:
        return None, version
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if leader else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, 0)
    if leader:
        return [g for _, g in fresh], version
    return [decode_group(b) for b in msgpack.unpackb(buf.numpy().tobytes(), raw=False)], version


def write_checksum(module: torch.nn.Module, path: Path, step: int) -> None:
    """Append the sum and hash of this rank's weights after ``step`` (``learner.metrics.rank_checksums``)."""
    h = hashlib.sha256()
    total = 0.0
    for name, p in sorted(module.state_dict().items()):
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
        total += float(p.double().sum())
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "sha256": h.hexdigest(), "sum": total}) + "\n")
