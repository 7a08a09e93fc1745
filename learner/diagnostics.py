"""The off-policy diagnostics of a step, from sums that add up over micro-batches and ranks.

``learner/losses.py`` returns, for each piece of a batch, the sums below; the learner adds them over
its micro-batches, reduces them over ranks (a sum, or the min/max for the ratio's extremes) and turns
them into the reported means. No torch here.

  tokens        loss tokens (completion tokens trained on)
  valid         of which the log-prob is defined (inside the sampling transform's kept set)
  kept          of which the correction kept (not masked)
  rho_sum/min/max   ρ = π_old/μ over valid tokens
  w_sum, w_sq_sum   Σw, Σw² of the correction weights of kept tokens (the effective sample size)
  truncated     valid tokens whose weight was truncated (tis, decoupled)
  clipped       valid tokens whose policy ratio was clipped
  mismatch_sum  Σ (log μ − log π_old) over valid tokens
  fresh_valid, fresh_mismatch_sum   the same over the valid tokens of samples of staleness 0
"""

from __future__ import annotations

EXTREMES = {"rho_min": min, "rho_max": max}


def effective_sample_size(w_sum: float, w_sq_sum: float, n: float) -> float:
    """(Σw)² / (n·Σw²) over n weights: 1 for equal weights, 1/n for a one-hot."""
    return 1.0 if n == 0 or w_sq_sum == 0 else w_sum**2 / (n * w_sq_sum)


def merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """The sums of two pieces of one batch."""
    return {k: EXTREMES[k](a[k], b[k]) if k in EXTREMES else a[k] + b[k] for k in a}


def summarise(s: dict[str, float]) -> dict[str, float]:
    """The reported diagnostics of a whole (mini)batch (docs/off-policy.md)."""
    valid = s["valid"]
    any_tok = valid > 0
    n_kept = s["kept"]
    return {
        "ratio_mean": s["rho_sum"] / valid if any_tok else 1.0,
        "ratio_min": s["rho_min"] if any_tok else 1.0,
        "ratio_max": s["rho_max"] if any_tok else 1.0,
        "ess": effective_sample_size(s["w_sum"], s["w_sq_sum"], n_kept),
        "frac_truncated": s["truncated"] / max(valid, 1.0),
        "frac_masked": 1 - n_kept / max(s["tokens"], 1.0) if s["tokens"] else 0.0,
        "frac_clipped": s["clipped"] / max(valid, 1.0),
        "mismatch_kl": s["mismatch_sum"] / max(valid, 1.0),
        # the engines' mismatch alone (sampled by the weights being trained); None without such tokens
        "mismatch_kl_fresh": s["fresh_mismatch_sum"] / s["fresh_valid"] if s["fresh_valid"] else None,
    }
