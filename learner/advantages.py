"""Advantage estimators.

Outcome estimators map one group's rewards [G] to per-sample advantages [G]; batch estimators
(REINFORCE++) see the whole batch; GAE and V-trace work on token-level rewards and values.
A group whose rewards are all equal gets zero advantage, never NaN.

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


# ``learner.advantage`` -> the estimator the learner applies to each group's rewards
GROUP_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"grpo": grpo, "drgrpo": drgrpo, "rloo": rloo}


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries, var unbiased (verl ``masked_whiten``)."""
    m = mask.bool()
    n = m.sum()
    mean = x[m].mean()
    var = ((x[m] - mean) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps)


def reinforce_pp(seq_rewards: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ for outcome rewards: each sample's reward on all its tokens, whitened over the
    batch's tokens [B, T]. With ``group_index`` the group mean is subtracted first (the "baseline"
    variant) (verl ``compute_reinforce_plus_plus_outcome_advantage`` with γ = 1 and
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``)."""
    r = seq_rewards.clone().float()
    if group_index is not None:
        for g in group_index.unique():
            sel = group_index == g
            if sel.sum() > 1:
                r[sel] = r[sel] - r[sel].mean()
    tok = r[:, None].expand_as(mask).clone() * mask
    return masked_whiten(tok, mask) * mask


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
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


def vtrace(token_rewards: torch.Tensor, values: torch.Tensor, log_rho: torch.Tensor, mask: torch.Tensor,
           gamma: float = 1.0, rho_bar: float = 1.0, c_bar: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
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
