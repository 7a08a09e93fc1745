"""Reading the replay queue: groups from the trajectories stream through the ``learner`` consumer
group, filtered for staleness and failed rewards, collated into padded tensors.

Nothing is acknowledged here: the trainer acknowledges a batch's stream entries only after the
optimizer step that used them (or after counting them as dropped).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import redis
import torch

from broker.keys import TRAJECTORIES_GROUP, Keys
from broker.protocol import Group, ProtocolError, decode_group

log = logging.getLogger("relay.learner.data")


@dataclass
class Batch:
    input_ids: torch.Tensor        # [B, L] prompt + completion, right-padded
    attention_mask: torch.Tensor   # [B, L]
    loss_mask: torch.Tensor        # [B, L-1] 1 where position t+1 is a completion token to train on
    behaviour_logp: torch.Tensor   # [B, L-1] μ of the token at t+1
    advantages: torch.Tensor       # [B, 1]
    staleness: list[int]           # per sample
    group_rewards: list[float]     # mean reward per group
    num_groups: int


@dataclass
class Reader:
    r: redis.Redis
    keys: Keys
    consumer: str = "learner-0"
    _pending_cursor: str | None = "0"  # walks this consumer's pending list once, then None: new entries
    stats: dict = field(default_factory=lambda: {"undecodable": 0})

    def read(self, want: int, block_ms: int = 1000) -> list[tuple[bytes, Group | None]]:
        """Up to ``want`` entries: first this consumer's unacknowledged ones (a previous learner's,
        after a restart), each once, then new ones. Undecodable entries come back as (id, None) so
        they are acknowledged and counted."""
        start = self._pending_cursor or ">"
        resp = self.r.xreadgroup(TRAJECTORIES_GROUP, self.consumer, {self.keys.trajectories: start},
                                 count=want, block=None if start != ">" else block_ms)
        entries = resp[0][1] if resp else []
        if start != ">":
            # the pending list keeps what we read until it is acknowledged: continue after the last id
            self._pending_cursor = entries[-1][0].decode() if entries else None
        out = []
        for eid, fields in entries:
            if not fields:  # deleted entry left in the pending list
                out.append((eid, None))
                continue
            try:
                out.append((eid, decode_group(fields[b"data"])))
            except (ProtocolError, KeyError) as e:
                self.stats["undecodable"] += 1
                log.error("undecodable stream entry %s: %s", eid, e)
                out.append((eid, None))
        return out

    def ack(self, ids: list[bytes]) -> None:
        if ids:
            pipe = self.r.pipeline()
            pipe.xack(self.keys.trajectories, TRAJECTORIES_GROUP, *ids)
            pipe.xdel(self.keys.trajectories, *ids)
            pipe.execute()


def trained_rewards(g: Group, failed_reward: str = "skip", fallback_score: float = 0.0) -> list[float | None]:
    """Per sample, the reward it is trained with: its own when the reward is ok; for a failed reward,
    None (left out) under ``skip`` or ``fallback_score`` under ``fallback``."""
    fallback = fallback_score if failed_reward == "fallback" else None
    return [s.reward if s.reward_status == "ok" and s.reward is not None else fallback for s in g.samples]


def group_mean_reward(g: Group, failed_reward: str = "skip", fallback_score: float = 0.0) -> float:
    """The mean reward a group is trained with (its samples left out by :func:`trained_rewards` excluded)."""
    kept = [r for r in trained_rewards(g, failed_reward, fallback_score) if r is not None]
    return sum(kept) / max(1, len(kept))


def collate(groups: list[Group], advantages: list[torch.Tensor], learner_version: int, pad_id: int,
            failed_reward: str = "skip", fallback_score: float = 0.0) -> Batch:
    """Samples left out by :func:`trained_rewards` (a failed reward under ``skip``) are not trained on
    (their advantage is not defined); ``advantages[i]`` has one entry per kept sample of group i."""
    rows, mus, advs, stale, group_rewards = [], [], [], [], []
    for g, adv in zip(groups, advantages):
        k = 0
        for s, reward in zip(g.samples, trained_rewards(g, failed_reward, fallback_score)):
            if reward is None:
                continue
            rows.append((g.prompt_ids.tolist(), s.completion_ids.tolist()))
            mus.append(s.logprobs.tolist())
            advs.append(float(adv[k]))
            stale.append(learner_version - s.min_version)
            k += 1
        group_rewards.append(group_mean_reward(g, failed_reward, fallback_score))
    L = max(len(p) + len(c) for p, c in rows)
    B = len(rows)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    lmask = torch.zeros((B, L - 1))
    mu = torch.zeros((B, L - 1))
    for i, ((p, c), m) in enumerate(zip(rows, mus)):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        attn[i, :n] = 1
        lmask[i, len(p) - 1:n - 1] = 1
        mu[i, len(p) - 1:n - 1] = torch.tensor(m)
    return Batch(ids, attn, lmask, mu, torch.tensor(advs)[:, None], stale, group_rewards, len(groups))


def wait_for(reader: Reader, want: int, should_stop, timeout_s: float) -> list[tuple[bytes, Group | None]]:
    """Block until ``want`` entries are read (or stop / timeout)."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and not should_stop():
        new = reader.read(want - len(got))
        got.extend(new)
        if new:
            deadline = time.monotonic() + timeout_s
        elif time.monotonic() > deadline:
            raise TimeoutError(f"no data for {timeout_s}s: are the generators running?")
    return got
