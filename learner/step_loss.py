"""The micro-batches of one optimizer step (learner/update.py): each one's loss terms and backward, the
gradients accumulated over them.

A micro-batch's loss is the off-policy-corrected policy loss (learner/losses.py), minus the entropy
bonus, plus, with a reference model and the KL not in the reward, the KL to the reference; with a
critic, its value loss on the same micro-batch takes its own backward. Every term is aggregated with
the :class:`~learner.losses.Normalisers` of the whole (mini)batch on all ranks, fixed before the first
micro-batch runs, so the accumulated gradient is that of the (mini)batch in one piece. A rank with
fewer micro-batches than the busiest runs empty backwards (a loss of 0 through every parameter): ZeRO
2-3 communicate at every backward.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from broker.runtime.config import ConfigError
from learner.config import LearnerConfig
from learner.correction import importance_weights
from learner.critic import critic_values, value_loss
from learner.data import Batch, Forwards
from learner.diagnostics import merge
from learner.logprobs import TokenLogprobs, batch_logprobs, token_logprobs
from learner.losses import Normalisers, aggregate, kl_estimate, policy_loss_terms
from learner.ranks import RankShare

NO_TOKENS = {
    "tokens": 0.0,
    "valid": 0.0,
    "kept": 0.0,
    "rho_sum": 0.0,
    "rho_min": float("inf"),
    "rho_max": float("-inf"),
    "w_sum": 0.0,
    "w_sq_sum": 0.0,
    "truncated": 0.0,
    "clipped": 0.0,
    "mismatch_sum": 0.0,
    "fresh_valid": 0.0,
    "fresh_mismatch_sum": 0.0,
}


@dataclass
class Accumulated:
    """What this rank's micro-batches of one (mini)batch add up to, before the reduction over ranks:
    the off-policy ``sums`` (learner/diagnostics.py), the ``totals`` of the reported losses and token
    counts, and whether every loss was finite."""

    sums: dict = field(default_factory=lambda: NO_TOKENS)
    totals: Counter = field(default_factory=Counter)
    loss_finite: bool = True
    value_finite: bool = True


class MicroBatchLoss:
    """The losses of the policy ``engine`` (with the frozen ``reference`` and the ``critic`` engine when
    configured) on this rank's micro-batches; ``pad_id`` fills the empty backwards."""

    def __init__(
        self,
        engine,
        cfg: LearnerConfig,
        ranks: RankShare,
        pad_id: int,
        forwards: Forwards,
        reference=None,
        critic=None,
    ):
        self.engine, self.cfg, self.ranks, self.pad_id, self.forwards = engine, cfg, ranks, pad_id, forwards
        self.reference, self.critic = reference, critic

    def normalisers(self, b: Batch, rows: torch.Tensor, old) -> tuple[Normalisers, Normalisers]:
        """The normalisers of the (mini)batch ``rows`` of the policy loss, and of the entropy bonus and
        the KL term, which count every sample with a loss token, rejected or not. T of seq-mean-token-sum-norm
        is the configured constant (learner.loss_scale_tokens or the generation budget), never a length of
        this batch: longer prompts, padding or packing leave the loss as it is."""
        if self.cfg.aggregation == "seq-mean-token-sum-norm" and not self.cfg.loss_scale:
            raise ConfigError("learner.aggregation = seq-mean-token-sum-norm needs learner.loss_scale_tokens > 0")
        norm = Normalisers(
            float(b.loss_mask[rows].sum()),
            self.sequences(b, rows, old),
            float(self.cfg.loss_scale),
            ranks=self.ranks.scale,
        )
        return norm, replace(norm, sequences=float((b.loss_mask[rows].sum(-1) > 0).sum()))

    def sequences(self, b: Batch, rows: torch.Tensor, old) -> float:
        """The samples of ``rows`` (on every rank) left with a kept token: the seq-mean modes' denominator.
        Without π_old (one update per batch, no rejecting correction, no top-k/top-p: every sample keeps its
        tokens; learner/update.py old_logprobs_up_front): the samples with a loss token."""
        if old is None:
            return float((b.loss_mask[rows].sum(-1) > 0).sum())
        mine = rows[self.ranks.owns(b.groups[rows])]
        valid = b.loss_mask[mine] * ~old[1][mine]
        _, keep = importance_weights(old[0][mine], b.behaviour_logp[mine], valid, self.cfg.correction)
        return self.ranks.reduce({"sequences": float((keep.sum(-1) > 0).sum())})["sequences"]

    def run(self, b: Batch, plans: list[list[torch.Tensor]], transform, old, norm, every) -> Accumulated:
        """The backwards of this rank's micro-batches of ``plans`` (every rank's), then the empty ones
        that keep it in step with the busiest rank."""
        acc = Accumulated()
        for part in plans[self.ranks.rank]:
            self.micro_batch(b, part, transform, old, norm, every, acc)
        for _ in range(max(len(p) for p in plans) - len(plans[self.ranks.rank])):
            self.empty_backward(transform)
        return acc

    def micro_batch(self, b: Batch, part: torch.Tensor, transform, old, norm, every, acc: Accumulated) -> None:
        """The loss terms and backward of the micro-batch ``part``, added to ``acc``."""
        cfg, world = self.cfg, self.ranks.scale  # the loss was multiplied by it (Normalisers.ranks)
        mb = b.select(part).to(self.ranks.device)
        mask = mb.loss_mask
        lp = batch_logprobs(
            self.engine,
            mb,
            transform,
            cfg.compute.logprob_chunk_tokens,
            True,
            self.forwards.shared,
            self.forwards.packed,
            sp=self.forwards.sp,
        )
        if old is None:  # one update per batch, nothing needed π_old first (old_logprobs_up_front): this forward's
            old_logp, outside = lp.logp.detach(), lp.outside
        else:
            width = mask.shape[1]
            old_logp = old[0][part, :width].to(self.ranks.device)
            outside = lp.outside | old[1][part, :width].to(self.ranks.device)
        valid = mask * ~outside
        fresh = torch.tensor([st == 0 for st in mb.staleness], device=mask.device)
        loss, s = policy_loss_terms(lp.logp, old_logp, mb.behaviour_logp, mb.advantages, mask, cfg, norm, valid, fresh)
        ent = aggregate(lp.entropy, mask, cfg.aggregation, every)
        if cfg.regularization.entropy_coef:
            loss = loss - cfg.regularization.entropy_coef * ent
        if self.reference is not None and not cfg.regularization.kl_in_reward:
            kl = self._reference_kl(mb, lp, valid, transform, every)
            loss = loss + cfg.regularization.kl_coef * kl
            acc.totals["kl_ref"] += float(kl.detach()) / world
        acc.loss_finite = acc.loss_finite and bool(torch.isfinite(loss.detach()))
        self.engine.backward(loss)
        if self.critic is not None:  # the same micro-batch, every sample with a loss token counted
            self._critic_backward(mb, every, acc)
        acc.sums = merge(acc.sums, s)
        acc.totals["loss"] += float(loss.detach()) / world
        acc.totals["entropy"] += float(ent.detach()) / world
        acc.totals["tokens_outside_kept_set"] += float((outside & mask.bool()).sum())
        forward, padded = self.forwards.tokens(mb)
        acc.totals["padded_tokens"] += padded
        acc.totals["forward_tokens"] += forward

    def _reference_kl(self, mb: Batch, lp: TokenLogprobs, valid, transform, every) -> torch.Tensor:
        """The aggregated KL estimate between the policy and the reference on ``mb``, over the tokens
        where both log-probs are defined."""
        with torch.no_grad():
            ref = batch_logprobs(
                self.reference,
                mb,
                transform,
                self.cfg.compute.logprob_chunk_tokens,
                False,
                self.forwards.shared,
                self.forwards.packed,
                sp=self.forwards.sp,
            )
        both = (valid * ~ref.outside).bool()  # the estimator is defined where both log-probs are
        return aggregate(
            kl_estimate(
                torch.where(both, lp.logp, 0.0), torch.where(both, ref.logp, 0.0), self.cfg.regularization.kl_estimator
            ),
            both.float(),
            self.cfg.aggregation,
            every,
        )

    def _critic_backward(self, mb: Batch, every, acc: Accumulated) -> None:
        """The critic's value loss on ``mb`` and its backward, added to ``acc``."""
        vloss, v = value_loss(
            critic_values(self.critic, mb.input_ids, mb.attention_mask, self.forwards.packed),
            mb.values,
            mb.returns,
            mb.loss_mask,
            self.cfg.critic.cliprange_value,
            self.cfg.aggregation,
            every,
        )
        acc.value_finite = acc.value_finite and bool(torch.isfinite(vloss.detach()))
        self.critic.backward(vloss)
        acc.totals["value_loss"] += float(vloss.detach()) / self.ranks.scale
        acc.totals["value_clipped"] += v["clipped"]

    def empty_backward(self, transform) -> None:
        """A backward of a loss of 0 through every parameter: keeps this rank's ZeRO collectives in step
        with ranks that have more micro-batches."""
        device = self.ranks.device
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=device)
        lp = token_logprobs(
            self.engine,
            ids,
            torch.ones_like(ids),
            torch.ones((1, 1), device=device),
            transform,
            self.cfg.compute.logprob_chunk_tokens,
        )
        self.engine.backward(lp.logp.sum() * 0.0)
        if self.critic is not None:
            self.critic.backward(self.critic(ids, torch.ones_like(ids)).sum() * 0.0)
