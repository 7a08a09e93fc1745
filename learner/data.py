"""From groups to tensors: the reward each sample is trained with, a batch collated into padded
tensors, and its micro-batches: samples of similar length, within a token budget.
(Groups are read from the replay queue by ``broker.client.queues.TrajectoryReader``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from broker.protocol.group import Group
from learner.packing import packed_micro_batches


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L-1] 1 where position t+1 is a completion token to train on (a token
    # the model sampled: not the context between a multi-turn sample's turns)
    behaviour_logp: torch.Tensor  # [B, L-1] μ of the token at t+1
    advantages: torch.Tensor  # [B, 1] one per sample, or [B, L-1] per token (gae, vtrace)
    staleness: list[int]  # per sample
    lengths: torch.Tensor  # [B] prompt + completion tokens of each sample (the rest is padding)
    groups: torch.Tensor  # [B] the index of each sample's group in the batch
    values: torch.Tensor | None = None  # [B, L-1] the critic's values before the update (with a critic)
    returns: torch.Tensor | None = None  # [B, L-1] the critic's targets (with a critic)
    prompt_lens: torch.Tensor | None = None  # [B] the prompt's tokens of each sample (its group's prompt)

    def select(self, rows: torch.Tensor) -> Batch:
        """The samples ``rows``, padded only to the longest of them."""
        width = int(self.lengths[rows].max()) if len(rows) else 1

        def tokens(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows, : width - 1] if t.shape[1] > 1 else t[rows]

        return Batch(
            self.input_ids[rows, :width],
            self.attention_mask[rows, :width],
            self.loss_mask[rows, : width - 1],
            self.behaviour_logp[rows, : width - 1],
            tokens(self.advantages),
            [self.staleness[i] for i in rows.tolist()],
            self.lengths[rows],
            self.groups[rows],
            tokens(self.values),
            tokens(self.returns),
            None if self.prompt_lens is None else self.prompt_lens[rows],
        )

    def to(self, device) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Batch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.loss_mask.to(device),
            self.behaviour_logp.to(device),
            self.advantages.to(device),
            self.staleness,
            self.lengths,
            self.groups,
            move(self.values),
            move(self.returns),
            self.prompt_lens,
        )


def micro_batches(lengths: torch.Tensor, rows: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """``rows`` split into micro-batches of samples of similar length: longest first, each filled while
    (samples × its longest sample) ≤ ``budget`` tokens. A sample longer than the budget is a
    micro-batch of its own."""
    order = rows[torch.argsort(lengths[rows], descending=True, stable=True)].tolist()
    out, cur, width = [], [], 0
    for i in order:
        n = int(lengths[i])
        if cur and (len(cur) + 1) * max(width, n) > budget:
            out.append(torch.tensor(cur))
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        out.append(torch.tensor(cur))
    return out


def group_micro_batches(
    lengths: torch.Tensor, prompt_lens: torch.Tensor, groups: torch.Tensor, rows: torch.Tensor, budget: int
) -> list[torch.Tensor]:
    """``rows`` split into micro-batches for the shared-prompt forward (learner/logprobs.py), which
    computes each distinct prompt of a micro-batch once: a group's samples kept together, groups in order
    of their longest sample, each micro-batch filled while its forward's tokens (distinct prompts × the
    longest prompt + samples × the longest completion) stay ≤ ``budget``. A group that does not fit is
    split (its prompt computed once per part); a sample longer than the budget is a micro-batch of its own."""
    comp = lengths - prompt_lens
    by_group: dict[int, list[int]] = {}
    for i in rows[torch.argsort(lengths[rows], descending=True, stable=True)].tolist():
        by_group.setdefault(int(groups[i]), []).append(i)  # each group's rows, longest first
    out, cur, seen, pw, cw = [], [], set(), 0, 0
    for members in by_group.values():  # groups in order of their longest row (dicts keep insertion order)
        for i in members:
            g, p, c = int(groups[i]), int(prompt_lens[i]), int(comp[i])
            cost = (len(seen | {g})) * max(pw, p) + (len(cur) + 1) * max(cw, c)
            if cur and cost > budget:
                out.append(torch.tensor(cur))
                cur, seen, pw, cw = [], set(), 0, 0
            cur.append(i)
            seen.add(g)
            pw, cw = max(pw, p), max(cw, c)
    if cur:
        out.append(torch.tensor(cur))
    return out


@dataclass
class Forwards:
    """How the learner cuts a batch into forwards: micro-batches of ``budget`` tokens and, with ``shared``
    (learner.compute.shared_prompt), each group's prompt computed once for its samples (learner/logprobs.py).
    One object read by every forward of a step (π_old, the reference, the loss), so they agree."""

    budget: int
    shared: bool = False
    packed: bool = False  # learner.compute.packing: each micro-batch one row without padding (learner/packing.py)
    # learner.compute.sequence_parallel > 1: each packed row split over a group of ranks (its SequenceGroup;
    # learner/sequence_parallel.py), ``budget`` the group's (k × micro_batch_tokens)
    sp: object | None = None

    def micro_batches(self, b: Batch, rows: torch.Tensor) -> list[torch.Tensor]:
        """``rows`` of ``b`` in micro-batches: packed, up to ``budget`` tokens each; a group's samples
        together when its prompt is computed once for them; else samples of similar length."""
        if self.packed:
            return packed_micro_batches(b.lengths, rows, self.budget)
        if self.shared and b.prompt_lens is not None:
            return group_micro_batches(b.lengths, b.prompt_lens, b.groups, rows, self.budget)
        return micro_batches(b.lengths, rows, self.budget)

    def tokens(self, mb: Batch) -> tuple[float, float]:
        """Token slots the forward of the micro-batch ``mb`` computes, and how many of them are padding."""
        if self.packed:
            return float(mb.lengths.sum()), 0.0
        if not self.shared or mb.prompt_lens is None:
            return float(mb.input_ids.numel()), float(mb.input_ids.numel() - mb.lengths.sum())
        _, first, _ = first_of_each(mb.groups)
        prompts, comp = mb.prompt_lens[first], mb.lengths - mb.prompt_lens
        forward = len(prompts) * int(prompts.max()) + len(comp) * int(comp.max())
        return float(forward), float(forward - prompts.sum() - comp.sum())


def first_of_each(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct values of ``groups``, the first row holding each, and each row's index among them."""
    values, which = torch.unique(groups, return_inverse=True)
    first = torch.full((len(values),), len(groups), dtype=torch.long, device=groups.device)
    first = first.scatter_reduce(0, which, torch.arange(len(groups), device=groups.device), reduce="amin")
    return values, first, which


def trained_rewards(g: Group, failed_reward: str = "skip", fallback_score: float = 0.0) -> list[float | None]:
    """Per sample, the reward it is trained with: its own when the reward is ok; for a failed reward,
    None (left out) under ``skip`` or ``fallback_score`` under ``fallback``."""
    fallback = fallback_score if failed_reward == "fallback" else None
    return [s.reward if s.reward_status == "ok" and s.reward is not None else fallback for s in g.samples]


def nonfinite_reason(g: Group, advantage_fn, failed_reward: str = "skip", fallback_score: float = 0.0) -> str | None:
    """What of ``g`` is not a finite float32 (None: all of it is): its trained rewards, its behaviour
    log-probs, the advantages ``advantage_fn`` gives them. The learner trains in float32, so a reward of
    1e300 (finite as float64) is infinite there and makes every advantage of its group NaN. The broker
    checks rewards and log-probs at ingest; this is the learner's own check behind it."""
    kept = [r for r in trained_rewards(g, failed_reward, fallback_score) if r is not None]
    rewards = torch.tensor(kept, dtype=torch.float64).to(torch.float32)
    if not bool(torch.isfinite(rewards).all()):
        return "a reward is not finite as float32"
    for i, s in enumerate(g.samples):
        if not bool(np.isfinite(np.asarray(s.logprobs, dtype=np.float32)).all()):
            return f"sample {i}'s behaviour log-probs are not all finite"
    if kept and not bool(torch.isfinite(advantage_fn(rewards)).all()):
        return "an advantage is not finite"
    return None


def group_mean_reward(g: Group, failed_reward: str = "skip", fallback_score: float = 0.0) -> float:
    """The mean reward a group is trained with (its samples left out by :func:`trained_rewards` excluded)."""
    kept = [r for r in trained_rewards(g, failed_reward, fallback_score) if r is not None]
    return sum(kept) / max(1, len(kept))


def completion_stats(groups: list[Group]) -> dict[str, float]:
    """Completion length (tokens: mean and max) and the fraction of completions stopped at
    ``max_tokens`` (``finish_reason`` "length") over every sample of ``groups``: the step's
    ``completion_len_mean``, ``completion_len_max`` and ``completion_truncated_frac`` metrics."""
    lengths = [len(s.completion_ids) for g in groups for s in g.samples]
    truncated = sum(s.finish_reason == "length" for g in groups for s in g.samples)
    n = max(1, len(lengths))
    return {
        "completion_len_mean": sum(lengths) / n,
        "completion_len_max": max(lengths, default=0),
        "completion_truncated_frac": truncated / n,
    }


def _scatter(out: np.ndarray, parts: list[np.ndarray], starts: np.ndarray) -> None:
    """Write ``parts[i]`` into row i of ``out`` from column ``starts[i]``, in one indexed assignment."""
    n = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    if not n.sum():
        return
    rows = np.repeat(np.arange(len(parts)), n)
    cols = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n) + np.repeat(starts, n)
    out[rows, cols] = np.concatenate(parts)


def collate(
    groups: list[Group],
    advantages: list[torch.Tensor],
    learner_version: int,
    pad_id: int,
    failed_reward: str = "skip",
    fallback_score: float = 0.0,
) -> Batch:
    """Samples left out by :func:`trained_rewards` (a failed reward under ``skip``) are not trained on
    (their advantage is not defined); ``advantages[i]`` has one entry per kept sample of group i.
    Vectorised: the token arrays are copied once each, by indexed assignment (no per-token Python)."""
    kept, advs = [], []
    for gi, (g, adv) in enumerate(zip(groups, advantages)):
        rewards = trained_rewards(g, failed_reward, fallback_score)
        mine = [s for s, reward in zip(g.samples, rewards) if reward is not None]
        kept += [(gi, g, s) for s in mine]
        advs.append(torch.as_tensor(adv, dtype=torch.float32).reshape(-1)[: len(mine)])
    B = len(kept)
    plen = np.fromiter((len(g.prompt_ids) for _, g, _ in kept), dtype=np.int64, count=B)
    clen = np.fromiter((len(s.completion_ids) for _, _, s in kept), dtype=np.int64, count=B)
    lengths = plen + clen
    L = int(lengths.max())
    ids = np.full((B, L), pad_id, dtype=np.int64)
    _scatter(ids, [g.prompt_ids for _, g, _ in kept], np.zeros(B, dtype=np.int64))
    _scatter(ids, [s.completion_ids for _, _, s in kept], plen)
    # position t predicts token t + 1: a completion's log-probs and loss mask start at its prompt's last token
    mu = np.zeros((B, L - 1), dtype=np.float32)
    _scatter(mu, [s.logprobs for _, _, s in kept], plen - 1)
    lmask = np.zeros((B, L - 1), dtype=np.float32)
    # a multi-turn sample trains only the tokens its model sampled, never the context between its turns
    _scatter(
        lmask,
        [np.ones(len(s.completion_ids), np.float32) if s.trainable is None else s.trainable for _, _, s in kept],
        plen - 1,
    )
    attn = torch.from_numpy((np.arange(L)[None, :] < lengths[:, None]).astype(np.int64))
    stale = [learner_version - s.min_version for _, _, s in kept]
    return Batch(
        torch.from_numpy(ids),
        attn,
        torch.from_numpy(lmask),
        torch.from_numpy(mu),
        torch.cat(advs)[:, None],
        stale,
        torch.from_numpy(lengths),
        torch.tensor([gi for gi, _, _ in kept]),
        prompt_lens=torch.from_numpy(plen),
    )
