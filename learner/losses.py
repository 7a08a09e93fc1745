"""Policy loss with off-policy correction, and its diagnostics.

Notation (docs/off-policy.md): μ behaviour log-probs from the generator, π_old the learner's
log-probs at the start of the step, π_θ the policy being trained, r = π_θ/π_old, ρ = π_old/μ.

  none: token-mean of -min(r·A, clip(r, 1±ε)·A)
  tis:  the same, each token weighted by sg(min(ρ, C))
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, behaviour_logp: torch.Tensor, adv: torch.Tensor,
                mask: torch.Tensor, clip_eps: float, mode: str = "tis", tis_cap: float = 2.0
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """All tensors [B, T] (adv broadcast per token). Returns (loss, diagnostics)."""
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    log_rho = (old_logp - behaviour_logp).detach()
    rho = torch.exp(log_rho)
    if mode == "tis":
        weight = rho.clamp(max=tis_cap)
    elif mode == "none":
        weight = torch.ones_like(rho)
    else:
        raise ValueError(f"unknown correction mode {mode!r}")
    loss = masked_mean(-surrogate * weight, mask)
    with torch.no_grad():
        m = mask.bool()
        w = weight[m]
        diag = {
            "ratio_mean": float(rho[m].mean()) if m.any() else 1.0,
            "ratio_min": float(rho[m].min()) if m.any() else 1.0,
            "ratio_max": float(rho[m].max()) if m.any() else 1.0,
            "ess": float(w.sum() ** 2 / (w.numel() * (w ** 2).sum())) if m.any() else 1.0,
            "frac_truncated": float((rho[m] > tis_cap).float().mean()) if mode == "tis" and m.any() else 0.0,
            "frac_clipped": float(((ratio - 1).abs() > clip_eps)[m].float().mean()) if m.any() else 0.0,
            "mismatch_kl": float(masked_mean(behaviour_logp - old_logp, mask)),
        }
    return loss, diag
