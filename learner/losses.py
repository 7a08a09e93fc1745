"""Policy losses, KL estimators and loss aggregation.

Notation (docs/off-policy.md): μ behaviour log-probs from the generator, π_old the learner's
log-probs at the start of the step (π_prox in AReaL), π_θ the policy being trained,
r = π_θ/π_old, ρ = π_old/μ, A the advantage, sg the stop-gradient. Every tensor is [B, T] over
completion tokens, with ``mask`` 1 on the tokens to train on.

A loss is: aggregate( w · ℓ(r, A) ) over kept tokens, where
  ℓ   the policy loss (``ppo`` clip with asymmetric bounds and dual-clip, ``cispo``,
      ``reinforce`` with a truncated ratio), and
  w   the off-policy correction weight from ρ (learner/correction.py), which may also drop
      tokens or sequences.
Each function names the verl ``core_algos.py`` function or paper it follows.

Aggregation divides by :class:`Normalisers` fixed for the whole (mini)batch on every rank before
its micro-batches run (verl's global batch info), so k micro-batches on n ranks accumulate exactly
the gradient of one piece on one rank. Tokens masked by the correction (or outside the sampling
transform's kept set) contribute 0 and still count in the token normaliser; the seq-mean modes count
only the sequences left with a kept token (verl ``agg_loss``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import get_args

import torch

from learner.config import Aggregation, KLEstimator, PolicyLoss, PolicyLossConfig
from learner.correction import importance_weights
from learner.diagnostics import summarise

POLICY_LOSSES = get_args(PolicyLoss)
AGGREGATIONS = get_args(Aggregation)
KL_ESTIMATORS = get_args(KLEstimator)
REINFORCE_CAP = 1.0  # the truncation c of the ratio in ``reinforce`` (PipelineRL's default)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------
# aggregation (verl ``agg_loss``)


@dataclass(frozen=True)
class Normalisers:
    """The denominators of :func:`aggregate` for a whole (mini)batch across all ranks."""

    tokens: float  # loss tokens (token-mean)
    sequences: float  # samples with at least one kept token (the seq-mean modes)
    length: float  # T of seq-mean-token-sum-norm: a constant (the learner's: learner.loss_scale_tokens)
    ranks: int = 1  # DeepSpeed averages gradients over ranks: each rank's share is multiplied by this

    @classmethod
    def of(cls, mask: torch.Tensor, kept: torch.Tensor | None = None) -> Normalisers:
        """Those of ``mask`` alone: one whole batch in one piece on one rank, T its width (verl's horizon, the
        response mask's width); ``kept`` (default: ``mask``) marks the tokens left after the correction's
        masking, which decide the sequences that count."""
        kept = mask if kept is None else kept
        return cls(float(mask.sum()), float((kept.sum(-1) > 0).sum()), float(mask.shape[-1]))

    def one_rank(self) -> Normalisers:
        """For diagnostics: summed over ranks, not averaged by DeepSpeed."""
        return replace(self, ranks=1)


def aggregate(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", norm: Normalisers | None = None
) -> torch.Tensor:
    """token-mean: Σ ℓ / Σ mask; seq-mean-token-sum: mean over sequences of Σ_t ℓ;
    seq-mean-token-mean: mean over sequences of mean_t ℓ; seq-mean-token-sum-norm: mean over
    sequences of Σ_t ℓ / T (T = ``norm.length``, a constant: Dr.GRPO's generation budget). "Sequences" are
    those with a kept token. The sums run over this piece's tokens (``mask``), the denominators are
    ``norm``'s (by default, those of ``mask``)."""
    norm = norm or Normalisers.of(mask)
    seq_sum = (loss_mat * mask).sum(-1)
    if mode == "token-mean":
        total = seq_sum.sum() / max(norm.tokens, 1.0)
    elif mode == "seq-mean-token-sum":
        total = seq_sum.sum() / max(norm.sequences, 1.0)
    elif mode == "seq-mean-token-mean":
        total = (seq_sum / mask.sum(-1).clamp(min=1)).sum() / max(norm.sequences, 1.0)
    elif mode == "seq-mean-token-sum-norm":
        total = seq_sum.sum() / (max(norm.sequences, 1.0) * max(norm.length, 1.0))
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    return total * norm.ranks


# ----------------------------------------------------------------------------------------------
# KL to a reference policy (Schulman's estimators; verl ``kl_penalty``)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π (verl ``kl_penalty_forward``).
    k1 = log π − log π_ref; abs = |k1|; k2 = ½(log π − log π_ref)²; k3 = π_ref/π − log(π_ref/π) − 1
    (≥ 0, unbiased, low variance; verl's ``low_var_kl``), its log-ratio clamped to ±20 and the value
    to at most 10 as verl does, so one token far from π_ref cannot dominate the loss."""
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        log_ratio = (-d).clamp(-20.0, 20.0)
        return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)}")


# ----------------------------------------------------------------------------------------------
# policy losses: per-token loss matrices


def ppo_loss_mat(
    logp, old_logp, adv, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip with asymmetric bounds and optional dual-clip (verl ``compute_policy_loss_vanilla``):
    ℓ = max(−r·A, −clip(r, 1−ε_low, 1+ε_high)·A); with dual-clip c, for A < 0: min(ℓ, −c·A).
    Returns (ℓ, clipped indicator)."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(l1, l2)
    clipped = (l2 > l1).float()
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError("dual_clip must be > 1")
        l3 = -adv * dual_clip
        loss = torch.where(adv < 0, torch.minimum(loss, l3), loss)
        clipped = torch.where((adv < 0) & (loss == l3), torch.ones_like(clipped), clipped)
    return loss, clipped


def cispo_loss_mat(
    logp, old_logp, adv, clip_high: float = 0.2, clip_low: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): ℓ = −sg(clip(r, 1−ε_low, 1+ε_high)) · A · log π_θ. The weight is clipped
    and detached; every token keeps its gradient (no token is zeroed by the clip)."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    lo = 0.0 if clip_low is None else 1 - clip_low
    w = ratio.clamp(lo, 1 + clip_high).detach()
    return -w * adv * logp, (ratio > 1 + clip_high).float()


def reinforce_loss_mat(logp, old_logp, adv, cap: float = REINFORCE_CAP) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with a truncated ratio (PipelineRL's default): ℓ = −sg(min(r, c)) · A · log π_θ."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    return -ratio.clamp(max=cap).detach() * adv * logp, (ratio > cap).float()


def policy_loss_mat(logp, old_logp, adv, cfg: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ per token for ``cfg.policy_loss``, with its clipped indicator."""
    clip_high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps
    if cfg.policy_loss == "ppo":
        return ppo_loss_mat(logp, old_logp, adv, cfg.clip_eps, clip_high, cfg.dual_clip)
    if cfg.policy_loss == "cispo":
        return cispo_loss_mat(logp, old_logp, adv, clip_high)
    if cfg.policy_loss == "reinforce":
        return reinforce_loss_mat(logp, old_logp, adv)
    raise ValueError(f"unknown policy loss {cfg.policy_loss!r}; valid: {', '.join(POLICY_LOSSES)}")


# ----------------------------------------------------------------------------------------------
# the whole policy loss


def policy_loss_terms(
    logp,
    old_logp,
    behaviour_logp,
    adv,
    mask,
    cfg: PolicyLossConfig,
    norm: Normalisers | None = None,
    valid: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """aggregate(w · ℓ) over kept tokens, and the sums its diagnostics are made of (learner/diagnostics.py),
    so that pieces of a batch add up. ``valid`` (default: ``mask``) leaves out tokens whose log-probs
    are not defined (outside the sampling transform's kept set): they are masked, and counted.
    ``fresh`` (per sample, default none) marks the samples of staleness 0, whose mismatch is the
    engines' numerics alone (μ and π_old are the same weights)."""
    valid = mask if valid is None else valid * mask
    fresh_valid = torch.zeros_like(valid) if fresh is None else valid * fresh[:, None].to(valid)
    w, keep = importance_weights(old_logp, behaviour_logp, valid, cfg.correction)
    mat, clipped = policy_loss_mat(logp, old_logp, adv, cfg)
    loss = aggregate(w * mat * keep, mask, cfg.aggregation, norm or Normalisers.of(mask, valid * keep))
    with torch.no_grad():
        m = valid.bool()
        rho = torch.exp(((old_logp - behaviour_logp) * valid).clamp(-20.0, 20.0))
        wk = (w * keep)[keep.bool()]
        any_tok = bool(m.any())
        sums = {
            "tokens": float(mask.sum()),
            "valid": float(m.sum()),
            "kept": float(keep.sum()),
            "rho_sum": float(rho[m].sum()),
            "rho_min": float(rho[m].min()) if any_tok else float("inf"),
            "rho_max": float(rho[m].max()) if any_tok else float("-inf"),
            "w_sum": float(wk.sum()),
            "w_sq_sum": float((wk**2).sum()),
            "truncated": float(((w < rho - 1e-12) & m).sum()) if cfg.correction.mode in ("tis", "decoupled") else 0.0,
            "clipped": float((clipped * valid).sum()),
            "mismatch_sum": float(((behaviour_logp - old_logp) * valid).sum()),
            "fresh_valid": float(fresh_valid.sum()),
            "fresh_mismatch_sum": float(((behaviour_logp - old_logp) * fresh_valid).sum()),
        }
    return loss, sums


def compute_policy_loss(
    logp, old_logp, behaviour_logp, adv, mask, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """aggregate(w · ℓ) over kept tokens of one whole batch, with diagnostics."""
    loss, sums = policy_loss_terms(logp, old_logp, behaviour_logp, adv, mask, cfg)
    return loss, summarise(sums)
