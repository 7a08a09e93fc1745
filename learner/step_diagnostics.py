"""The diagnostics a training step reports (learner/update.py, docs/learner.md): each optimizer step's,
reduced over ranks from what its micro-batches added up, and the batch's, over its optimizer steps.
"""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist

from learner.critic import explained_variance
from learner.data import Batch
from learner.diagnostics import EXTREMES, summarise
from learner.ranks import RankShare
from learner.step_loss import Accumulated

TOTALS = (
    "loss",
    "entropy",
    "kl_ref",
    "tokens_outside_kept_set",
    "padded_tokens",
    "forward_tokens",
    "value_loss",
    "value_clipped",
)


def optimizer_step_diagnostics(
    ranks: RankShare, acc: Accumulated, micro_batches: int, tokens: float, reference_kl: bool, critic: bool
) -> dict:
    """One optimizer step's diagnostics over every rank: ``acc`` (this rank's) reduced over ``ranks``,
    ``micro_batches`` run by all of them on its ``tokens`` loss tokens; ``reference_kl``: the loss has the
    KL to the reference (its ``kl_ref``); ``critic``: a critic was trained (its value loss)."""
    sums = {
        **ranks.reduce({k: v for k, v in acc.sums.items() if k not in EXTREMES}),
        **ranks.reduce({"rho_min": acc.sums["rho_min"]}, dist.ReduceOp.MIN),
        **ranks.reduce({"rho_max": acc.sums["rho_max"]}, dist.ReduceOp.MAX),
    }
    totals = ranks.reduce({k: acc.totals[k] for k in TOTALS})
    diag = summarise(sums)
    diag.update(
        loss=totals["loss"],
        entropy=totals["entropy"],
        micro_batches=micro_batches,
        tokens_outside_kept_set=int(totals["tokens_outside_kept_set"]),
        padded_tokens=totals["padded_tokens"],
        forward_tokens=totals["forward_tokens"],
    )
    if reference_kl:
        diag["kl_ref"] = totals["kl_ref"]
    if critic:  # verl's critic/vf_loss and critic/vf_clipfrac
        diag.update(value_loss=totals["value_loss"], value_clip_frac=totals["value_clipped"] / max(tokens, 1.0))
    return diag


def batch_diagnostics(steps: list[dict], b: Batch, lr: float, compute_s: float) -> dict:
    """The batch ``b``'s diagnostics over its optimizer ``steps`` (each one's diagnostics, with its
    ``skipped`` reason and ``grad_norm``): the means, the extremes and the sums, the learning rate ``lr``
    and the ``compute_s`` the step took."""
    skipped = [d.pop("skipped") for d in steps]
    fresh = [f for f in (d.pop("mismatch_kl_fresh") for d in steps) if f is not None]
    norms = [n for n in (d.pop("grad_norm") for d in steps) if n is not None]
    diag = {k: sum(d[k] for d in steps) / len(steps) for k in steps[0]}
    diag["mismatch_kl_fresh"] = sum(fresh) / len(fresh) if fresh else None
    # the largest global gradient norm (before clipping) of the batch's optimizer steps, and the learning rate
    diag["grad_norm"] = max(norms) if norms else None
    diag["lr"] = lr
    padded, forward = sum(d.pop("padded_tokens") for d in steps), sum(d.pop("forward_tokens") for d in steps)
    diag.update(
        ratio_min=min(d["ratio_min"] for d in steps),
        ratio_max=max(d["ratio_max"] for d in steps),
        micro_batches=sum(d["micro_batches"] for d in steps),
        tokens_outside_kept_set=sum(d["tokens_outside_kept_set"] for d in steps),
        padding_fraction=padded / forward if forward else 0.0,
        compute_s=compute_s,
        samples=len(b.lengths),
        tokens=int(b.loss_mask.sum()),
        staleness={str(k): v for k, v in sorted(Counter(b.staleness).items())},
    )
    diag.pop("padded_tokens"), diag.pop("forward_tokens")
    # optimizer steps of this batch skipped for a non-finite loss or gradient (and the first reason, when any)
    diag.update(updates_skipped=sum(s is not None for s in skipped), optimizer_steps=len(steps))
    if diag["updates_skipped"]:
        diag["skip_reason"] = next(s for s in skipped if s)
    return diag


def critic_diagnostics(b: Batch) -> dict:
    """Of the critic's values before this step's update (verl's critic/* metrics)."""
    m = b.loss_mask.bool()
    return dict(
        explained_variance=explained_variance(b.returns, b.values, b.loss_mask),
        values_mean=float(b.values[m].mean()) if m.any() else 0.0,
        returns_mean=float(b.returns[m].mean()) if m.any() else 0.0,
    )
