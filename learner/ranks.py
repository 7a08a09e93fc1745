"""Data-parallel ranks: the leader's batch shared with every rank, each rank's share of it and the
reductions over ranks, and per-rank weight checksums."""

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


class RankShare:
    """This process's share of a batch: data-parallel rank ``rank`` of ``world``, whose collectives run on
    ``device``. Every rank holds the whole batch and trains the samples of its groups (group i on data-parallel
    rank i mod ``world``); what a rank computes of its samples alone is summed (or ``op``) over ranks.

    With sequence parallelism (learner/sequence_parallel.py) the ``scale`` ranks of the world are ``world``
    data-parallel ranks of ``scale // world`` each: the ranks of one sequence-parallel group compute the same
    numbers of the same samples, so sums run over ``group`` (the data-parallel ranks with this rank's place in
    its group); DeepSpeed averages gradients over all ``scale`` ranks, each of which holds part of its group's
    gradient, so every loss is multiplied by ``scale``."""

    def __init__(self, rank: int, world: int, device, group=None, scale: int | None = None):
        self.rank, self.world, self.device, self.group = rank, world, device, group
        self.scale = world if scale is None else scale

    def owns(self, groups: torch.Tensor) -> torch.Tensor:
        """Which of the samples of ``groups`` (their group index) this rank trains."""
        return groups % self.world == self.rank

    def reduce(self, values: dict[str, float], op=dist.ReduceOp.SUM) -> dict[str, float]:
        """``values`` summed (or ``op``) over data-parallel ranks."""
        if self.world == 1 or not values:
            return values
        return self._all_reduce(values, op, self.group)

    def everywhere(self, values: dict[str, float], op=dist.ReduceOp.MAX) -> dict[str, float]:
        """``values`` reduced with ``op`` over every rank of the world (sequence-parallel ones included)."""
        if self.scale == 1 or not values:
            return values
        return self._all_reduce(values, op, None)

    def _all_reduce(self, values: dict[str, float], op, group) -> dict[str, float]:
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=group)
        return dict(zip(values, t.tolist()))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over data-parallel ranks, on the CPU (with several ranks; callers skip it with one)."""
        t = t.to(self.device)
        dist.all_reduce(t, group=self.group)
        return t.cpu()
