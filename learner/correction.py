"""Off-policy correction: the importance weights from ρ = π_old / μ (their effective sample size is
reported by learner/diagnostics.py).

μ is the behaviour log-prob recorded by the generator, π_old the learner's log-prob of the same token
at the start of the step (docs/off-policy.md). Every tensor is [B, T] over completion tokens, with
``mask`` 1 on the tokens to train on. The modes are ``learner.correction.mode`` (learner/config.py).
"""

from __future__ import annotations

from typing import get_args

import torch

from learner.config import CorrectionConfig, CorrectionMode

CORRECTIONS = get_args(CorrectionMode)
REJECTING = ("mis", "token_mis", "seq_mis", "geo_mis")  # the modes whose ``keep`` can drop a whole sequence


def importance_weights(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weight [B, T], keep [B, T]); both detached. ``keep`` masks tokens (or whole
    sequences) out of the loss; ``weight`` multiplies the policy loss of kept tokens.

      none        w = 1
      tis         w = min(ρ, C)                                        (Yao et al. 2025)
      decoupled   w = ρ (min(ρ, C) when C is set): AReaL's π_prox/μ factor; with the PPO loss on
                  u = π_θ/π_prox this is decoupled PPO. The same weight as tis.
      mis         w = 1, tokens with ρ > hi masked
      token_mis   w = 1, tokens with ρ outside [lo, hi] masked           (verl's token rejection, ``token_k1``)
      icepop      w = ρ inside [lo, hi], 0 outside; nothing masked       (verl's token-level IcePop)
      seq_tis     w = min(exp(Σ_t log ρ_t), C) per sequence
      seq_mis     w = 1, sequences with exp(Σ log ρ) outside [lo, hi] masked
      geo_mis     w = 1, sequences with exp(mean log ρ) outside [lo, hi] masked

    C = ``tis_cap``, [lo, hi] = [``mask_lo``, ``mask_hi``].
    """
    log_rho = ((old_logp - behaviour_logp) * mask).detach()
    rho = torch.exp(log_rho.clamp(-20.0, 20.0))
    ones = torch.ones_like(rho)
    keep = mask.clone()
    mode, cap, lo, hi = cfg.mode, cfg.tis_cap, cfg.mask_lo, cfg.mask_hi
    if mode == "none":
        w = ones
    elif mode in ("tis", "decoupled"):
        w = rho.clamp(max=cap) if cap is not None else rho
    elif mode == "mis":
        w, keep = ones, keep * (rho <= hi).float()
    elif mode == "token_mis":
        w, keep = ones, keep * ((rho >= lo) & (rho <= hi)).float()
    elif mode == "icepop":  # out-of-band tokens weigh 0 but stay in the mask (and the token-mean denominator)
        w = torch.where((rho >= lo) & (rho <= hi), rho, torch.zeros_like(rho))
    elif mode in ("seq_tis", "seq_mis", "geo_mis"):
        seq_log = log_rho.sum(-1)
        if mode == "geo_mis":
            seq_log = seq_log / mask.sum(-1).clamp(min=1)
        seq_rho = torch.exp(seq_log.clamp(-20.0, 20.0))[:, None].expand_as(rho)
        if mode == "seq_tis":
            w = seq_rho.clamp(max=cap) if cap is not None else seq_rho
        else:
            w, keep = ones, keep * ((seq_rho >= lo) & (seq_rho <= hi)).float()
    else:
        raise ValueError(f"unknown correction mode {mode!r}; valid: {', '.join(CORRECTIONS)}")
    return w.detach(), keep.detach()
