"""From groups to tensors: the reward each sample is trained with, and a batch collated into padded
tensors. (Groups are read from the replay queue by ``broker.client.queues.TrajectoryReader``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from broker.protocol.group import Group

@dataclass
class Batch:
    input_ids: torch.Tensor        # [B, L] prompt + completion, right-padded
    attention_mask: torch.Tensor   # [B, L]
    loss_mask: torch.Tensor        # [B, L-1] 1 where position t+1 is a completion token to train on
    behaviour_logp: torch.Tensor   # [B, L-1] μ of the token at t+1
    advantages: torch.Tensor       # [B, 1]
    staleness: list[int]           # per sample


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
    rows, mus, advs, stale = [], [], [], []
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
    return Batch(ids, attn, lmask, mu, torch.tensor(advs)[:, None], stale)
