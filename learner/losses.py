"""Policy losses, off-policy correction, KL estimators and loss aggregation.

Notation (docs/off-policy.md): μ behaviour log-probs from the generator, π_old the learner's
log-probs at the start of the step (π_prox in AReaL), π_θ the policy being trained,
r = π_θ/π_old, ρ = π_old/μ, A the advantage, sg the stop-gradient. Every tensor is [B, T] over
completion tokens, with ``mask`` 1 on the tokens to train on.

A loss is: aggregate( w · ℓ(r, A) ) over kept tokens, where
  ℓ   the policy loss (``ppo`` clip with asymmetric bounds and dual-clip, ``cispo``,
      ``reinforce`` with a truncated ratio), and
  w   the off-policy correction weight from ρ (``none``, ``tis``, ``mis`` / IcePop masking,
      sequence and geometric levels, ``decoupled``), which may also drop tokens or sequences.
Each function names the verl ``core_algos.py`` function or paper it follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POLICY_LOSSES = ("ppo", "cispo", "reinforce")
CORRECTIONS = ("none", "tis", "mis", "icepop", "seq_tis", "seq_mis", "geo_mis", "decoupled")
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------
# aggregation (verl ``agg_loss``)


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """token-mean: Σ ℓ / Σ mask; seq-mean-token-sum: mean over sequences of Σ_t ℓ;
    seq-mean-token-mean: mean over sequences of mean_t ℓ; seq-mean-token-sum-norm: Σ ℓ / T
    (T = the padded length, Dr.GRPO's constant normaliser)."""
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_sum = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    if mode == "seq-mean-token-mean":
        return (seq_sum / mask.sum(-1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum-norm":
        return seq_sum.sum() / mask.shape[-1]
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


# ----------------------------------------------------------------------------------------------
# KL to a reference policy (Schulman's estimators; verl ``kl_penalty``)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π.
    k1 = log π − log π_ref; k2 = ½(log π − log π_ref)²; k3 = π_ref/π − log(π_ref/π) − 1 (≥ 0,
    unbiased, low variance)."""
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d ** 2
    if kind == "k3":
        return torch.exp(-d) + d - 1
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


# ----------------------------------------------------------------------------------------------
# policy losses: per-token loss matrices


def ppo_loss_mat(logp, old_logp, adv, clip_low: float = 0.2, clip_high: float = 0.2,
                 dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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


def cispo_loss_mat(logp, old_logp, adv, clip_high: float = 0.2, clip_low: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): ℓ = −sg(clip(r, 1−ε_low, 1+ε_high)) · A · log π_θ. The weight is clipped
    and detached; every token keeps its gradient (no token is zeroed by the clip)."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    lo = 0.0 if clip_low is None else 1 - clip_low
    w = ratio.clamp(lo, 1 + clip_high).detach()
    return -w * adv * logp, (ratio > 1 + clip_high).float()


def reinforce_loss_mat(logp, old_logp, adv, cap: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with a truncated ratio (PipelineRL's default): ℓ = −sg(min(r, c)) · A · log π_θ."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    return -ratio.clamp(max=cap).detach() * adv * logp, (ratio > cap).float()


# ----------------------------------------------------------------------------------------------
# off-policy correction weights from ρ = π_old / μ


@dataclass
class CorrectionSpec:
    """mode: one of CORRECTIONS. cap: truncation C (tis, seq_tis, decoupled cap; None = none).
    lo/hi: the kept interval of ρ for masking modes (mis: hi only; icepop, seq_mis, geo_mis: both)."""

    mode: str = "tis"
    cap: float | None = 2.0
    lo: float = 0.5
    hi: float = 5.0


def correction(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, spec: CorrectionSpec
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weight [B, T], keep [B, T]); both detached. ``keep`` masks tokens (or whole
    sequences) out of the loss; ``weight`` multiplies the policy loss of kept tokens.

      none        w = 1
      tis         w = min(ρ, C)                                        (Yao et al. 2025)
      mis         w = 1, tokens with ρ > hi masked
      icepop      w = 1, tokens with ρ outside [lo, hi] masked           (two-sided token masking)
      seq_tis     w = min(exp(Σ_t log ρ_t), C) per sequence
      seq_mis     w = 1, sequences with exp(Σ log ρ) outside [lo, hi] masked
      geo_mis     w = 1, sequences with exp(mean log ρ) outside [lo, hi] masked
      decoupled   w = ρ (min(ρ, C) when C is set): AReaL's π_prox/μ factor; with the PPO loss on
                  u = π_θ/π_prox this is decoupled PPO.
    """
    log_rho = ((old_logp - behaviour_logp) * mask).detach()
    rho = torch.exp(log_rho.clamp(-20.0, 20.0))
    ones = torch.ones_like(rho)
    keep = mask.clone()
    mode = spec.mode
    if mode == "none":
        w = ones
    elif mode == "tis":
        w = rho.clamp(max=spec.cap) if spec.cap is not None else rho
    elif mode == "decoupled":
        w = rho.clamp(max=spec.cap) if spec.cap is not None else rho
    elif mode == "mis":
        w, keep = ones, keep * (rho <= spec.hi).float()
    elif mode == "icepop":
        w, keep = ones, keep * ((rho >= spec.lo) & (rho <= spec.hi)).float()
    elif mode in ("seq_tis", "seq_mis", "geo_mis"):
        seq_log = log_rho.sum(-1)
        if mode == "geo_mis":
            seq_log = seq_log / mask.sum(-1).clamp(min=1)
        seq_rho = torch.exp(seq_log.clamp(-20.0, 20.0))[:, None].expand_as(rho)
        if mode == "seq_tis":
            w = seq_rho.clamp(max=spec.cap) if spec.cap is not None else seq_rho
        else:
            w, keep = ones, keep * ((seq_rho >= spec.lo) & (seq_rho <= spec.hi)).float()
    else:
        raise ValueError(f"unknown correction mode {mode!r}; valid: {', '.join(CORRECTIONS)}")
    return w.detach(), keep.detach()


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> float:
    """(Σw)² / (n·Σw²) over masked entries: 1 for equal weights, 1/n for a one-hot."""
    w = weights[mask.bool()]
    if w.numel() == 0 or float((w ** 2).sum()) == 0.0:
        return 1.0
    return float(w.sum() ** 2 / (w.numel() * (w ** 2).sum()))


# ----------------------------------------------------------------------------------------------
# the whole policy loss


@dataclass
class LossSpec:
    policy: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    reinforce_cap: float = 1.0
    aggregation: str = "token-mean"
    correction: CorrectionSpec | None = None


def compute_policy_loss(logp, old_logp, behaviour_logp, adv, mask, spec: LossSpec
                        ) -> tuple[torch.Tensor, dict[str, float]]:
    """aggregate(w · ℓ) over kept tokens, with diagnostics."""
    corr = spec.correction or CorrectionSpec(mode="none")
    w, keep = correction(old_logp, behaviour_logp, mask, corr)
    if spec.policy == "ppo":
        mat, clipped = ppo_loss_mat(logp, old_logp, adv, spec.clip_low, spec.clip_high, spec.dual_clip)
    elif spec.policy == "cispo":
        mat, clipped = cispo_loss_mat(logp, old_logp, adv, spec.clip_high)
    elif spec.policy == "reinforce":
        mat, clipped = reinforce_loss_mat(logp, old_logp, adv, spec.reinforce_cap)
    else:
        raise ValueError(f"unknown policy loss {spec.policy!r}; valid: {', '.join(POLICY_LOSSES)}")
    loss = aggregate(w * mat, keep, spec.aggregation)
    with torch.no_grad():
        m = mask.bool()
        rho = torch.exp(((old_logp - behaviour_logp) * mask).clamp(-20.0, 20.0))
        any_tok = bool(m.any())
        diag = {
            "ratio_mean": float(rho[m].mean()) if any_tok else 1.0,
            "ratio_min": float(rho[m].min()) if any_tok else 1.0,
            "ratio_max": float(rho[m].max()) if any_tok else 1.0,
            "ess": effective_sample_size(w * keep, keep),
            "frac_truncated": float(((w < rho - 1e-12) & m).float().sum() / m.sum().clamp(min=1))
            if corr.mode in ("tis", "decoupled") else 0.0,
            "frac_masked": float(1 - keep.sum() / mask.sum().clamp(min=1)),
            "frac_clipped": float(masked_mean(clipped, mask)),
            "mismatch_kl": float(masked_mean(behaviour_logp - old_logp, mask)),
        }
    return loss, diag
