"""Advantage estimators.

Outcome estimators map one group's rewards [G] to per-sample advantages [G]; batch estimators
(REINFORCE++) see the whole batch; GAE and V-trace work on token-level rewards and values.
A group whose rewards are all equal gets zero advantage, never NaN. A group left with a single
sample (the others' rewards failed) has no baseline of its own: its centred reward is 0 (verl
keeps its raw score, mean 0 and std 1; docs/off-policy.md says why Relay does not).

Each function names the verl ``core_algos.py`` function whose formula it follows.
"""

from __future__ import annotations

from typing import Callable

import torch


def grpo(rewards: torch.Tensor, eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """(r - mean) / (std + eps), std unbiased; without std for Dr.GRPO
    (verl ``compute_grpo_outcome_advantage``, ``norm_adv_by_std_in_grpo``)."""
    if rewards.numel() < 2 or bool(rewards.max() == rewards.min()):
        return torch.zeros_like(rewards)  # exactly 0 (no floating residue blown up by 1/eps)
    centred = rewards - rewards.mean()
    return centred / (rewards.std() + eps) if norm_by_std else centred


def drgrpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: the group mean as baseline, no std scaling."""
    return grpo(rewards, norm_by_std=False)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean_{j≠i} r_j = G/(G-1)·(r_i - mean)
    (verl ``compute_rloo_outcome_advantage``)."""
    g = rewards.numel()
    if g < 2 or bool(rewards.max() == rewards.min()):
        return torch.zeros_like(rewards)
    return g / (g - 1) * (rewards - rewards.mean())


# ``learner.advantages.estimator`` -> the estimator the learner applies to each group's rewards
GROUP_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"grpo": grpo, "drgrpo": drgrpo, "rloo": rloo}


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries, var unbiased (verl ``masked_whiten``)."""
    m = mask.bool()
    n = m.sum()
    mean = x[m].mean()
    var = ((x[m] - mean) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps)


def reinforce_pp(
    rewards: torch.Tensor, tokens: torch.Tensor, group_index: torch.Tensor | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ for outcome rewards, per sample [B]. The outcome reward sits on the last token, so
    with γ = 1 every token of sample i has the return r_i; those returns are whitened over the batch's
    tokens (``tokens[i]`` completion tokens of sample i): (r_i − μ) / sqrt(σ² + eps), μ and the
    unbiased σ² weighted by tokens. With ``group_index`` each group's mean is subtracted first (the
    "baseline" variant; a group of one is centred to 0). (verl
    ``compute_reinforce_plus_plus_outcome_advantage`` with γ = 1 and
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``, whose per-token advantages are
    constant along each sample and equal these.) Fewer than 2 tokens or equal returns: exactly 0."""
    r = rewards.clone().to(torch.float64)
    if group_index is not None:
        for g in group_index.unique():
            sel = group_index == g
            r[sel] = r[sel] - r[sel].mean()
    n = tokens.to(torch.float64)
    total = n.sum()
    live = r[n > 0]
    if total < 2 or live.numel() == 0 or bool(live.max() == live.min()):
        return torch.zeros_like(rewards)
    mean = (n * r).sum() / total
    var = (n * (r - mean) ** 2).sum() / (total - 1)
    return ((r - mean) * torch.rsqrt(var + eps)).to(rewards.dtype)


def reinforce_pp_baseline(rewards: torch.Tensor, tokens: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with the group mean as baseline (verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``)."""
    return reinforce_pp(rewards, tokens, group_index)


# ``learner.advantages.estimator`` -> an estimator of the whole batch: (rewards [B], completion tokens [B], group index [B])
BATCH_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "reinforce_pp": lambda r, n, _index: reinforce_pp(r, n),
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def batch_advantages(estimator: str, rewards: list[torch.Tensor], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """The advantages of one training batch: per group, one per kept sample. ``rewards[i]`` and
    ``tokens[i]`` are group i's kept samples' rewards and completion lengths; a group estimator sees
    one group at a time, a batch estimator the whole batch."""
    if estimator in GROUP_ESTIMATORS:
        return [GROUP_ESTIMATORS[estimator](r) for r in rewards]
    if estimator in BATCH_ESTIMATORS:
        sizes = [len(r) for r in rewards]
        index = torch.repeat_interleave(torch.arange(len(rewards)), torch.tensor(sizes))
        flat = BATCH_ESTIMATORS[estimator](torch.cat(rewards), torch.cat(tokens), index)
        return list(flat.split(sizes))
    valid = ", ".join([*GROUP_ESTIMATORS, *BATCH_ESTIMATORS])
    raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {valid}")


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over tokens [B, T]; returns (advantages, returns), the
    advantages not yet whitened (verl ``compute_gae_advantage_return`` before ``masked_whiten``)."""
    B, T = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(B)
    last = torch.zeros(B)
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        cur = delta + gamma * lam * last
        m = mask[:, t]
        next_value = values[:, t] * m + (1 - m) * next_value
        last = cur * m + (1 - m) * last
        adv[:, t] = last
    return adv, adv + values


def vtrace(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    log_rho: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets (Espeholt et al. 2018, IMPALA) over tokens [B, T], bootstrap value 0 after
    the last token: v_s = V(x_s) + Σ_t γ^{t-s} (Π_{i=s}^{t-1} c_i) ρ_t δ_t with
    ρ_t = min(ρ̄, π/μ), c_i = min(c̄, π/μ), δ_t = r_t + γV(x_{t+1}) − V(x_t).
    Returns (vs, policy-gradient advantages ρ_s (r_s + γ v_{s+1} − V(x_s))).
    On-policy with ρ̄ = c̄ = 1 the targets equal the n-step (Monte-Carlo) return."""
    B, T = token_rewards.shape
    ratio = torch.exp(log_rho)
    rho = ratio.clamp(max=rho_bar) * mask
    c = ratio.clamp(max=c_bar) * mask
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(B, 1)], dim=1)
    deltas = rho * (token_rewards + gamma * next_values - values) * mask
    vs_minus_v = torch.zeros_like(values)
    acc = torch.zeros(B)
    for t in reversed(range(T)):
        acc = deltas[:, t] + gamma * c[:, t] * acc * (mask[:, t + 1] if t + 1 < T else 0.0)
        vs_minus_v[:, t] = acc
    vs = (values + vs_minus_v) * mask
    vs_next = torch.cat([vs[:, 1:] * mask[:, 1:], torch.zeros(B, 1)], dim=1)
    pg_adv = rho * (token_rewards + gamma * vs_next - values) * mask
    return vs, pg_adv
