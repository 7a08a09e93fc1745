"""What a training step computes of its batch before the first update (learner/update.py): π_old, the
KL to the reference that goes into the rewards (``kl_in_reward``), and the critic's values and targets.

Each rank computes these for its own samples, without gradient; where every rank needs all of them
(the sequence KL, the critic's targets), a sum over ranks gives every rank the whole batch's.
"""

from __future__ import annotations

import torch

from learner.advantages import gae, masked_whiten, vtrace
from learner.config import NEEDS_CRITIC, LearnerConfig
from learner.critic import critic_values
from learner.data import Batch, Forwards
from learner.logprobs import batch_logprobs
from learner.losses import kl_estimate
from learner.ranks import RankShare


class StepInputs:
    """The forwards without gradient of the policy ``engine``, the frozen ``reference`` and the
    ``critic`` (either may be None when not configured) on this rank's share of a batch."""

    def __init__(self, engine, cfg: LearnerConfig, ranks: RankShare, forwards: Forwards, reference=None, critic=None):
        self.engine, self.cfg, self.ranks, self.reference, self.critic = engine, cfg, ranks, reference, critic
        self.forwards = forwards

    def old_logprobs(self, b: Batch, rows: torch.Tensor, transform) -> tuple[torch.Tensor, torch.Tensor]:
        """π_old of ``rows`` (this rank's) and where its token is outside the kept set, before any update."""
        logp, outside = torch.zeros_like(b.behaviour_logp), torch.zeros_like(b.loss_mask, dtype=torch.bool)
        with torch.no_grad():
            for part in self.forwards.micro_batches(b, rows):
                mb = b.select(part)
                lp = batch_logprobs(
                    self.engine,
                    mb.to(self.ranks.device),
                    transform,
                    self.cfg.compute.logprob_chunk_tokens,
                    False,
                    self.forwards.shared,
                    self.forwards.packed,
                    sp=self.forwards.sp,
                )
                width = mb.loss_mask.shape[1]
                logp[part, :width], outside[part, :width] = lp.logp.cpu(), lp.outside.cpu()
        return logp, outside

    def sequence_kl(self, b: Batch, old, transform) -> tuple[torch.Tensor, float]:
        """Per sample [B] (every rank's), Σ_t of the KL estimate between π_old and π_ref over the tokens
        where both are defined (verl ``apply_kl_penalty``'s kld, summed as the outcome estimators sum the
        token rewards), and those tokens' count."""
        kl, tokens = torch.zeros(len(b.lengths), dtype=torch.float64), 0.0
        mine = torch.arange(len(b.lengths))[self.ranks.owns(b.groups)]
        with torch.no_grad():
            for part in self.forwards.micro_batches(b, mine):
                mb = b.select(part)
                width = mb.loss_mask.shape[1]
                ref = batch_logprobs(
                    self.reference,
                    mb.to(self.ranks.device),
                    transform,
                    self.cfg.compute.logprob_chunk_tokens,
                    False,
                    self.forwards.shared,
                    self.forwards.packed,
                    sp=self.forwards.sp,
                )
                both = mb.loss_mask.bool() & ~old[1][part, :width] & ~ref.outside.cpu()
                est = kl_estimate(old[0][part, :width], ref.logp.cpu(), self.cfg.regularization.kl_estimator)
                kl[part] = torch.where(both, est, 0.0).sum(-1).double()
                tokens += float(both.sum())
        if self.ranks.world > 1:  # each sample is summed on the one rank that trains it
            t = self.ranks.sum(torch.cat([kl, torch.tensor([tokens], dtype=torch.float64)]))
            kl, tokens = t[:-1], float(t[-1])
        return kl, tokens

    def values(self, b: Batch, rows: torch.Tensor) -> torch.Tensor:
        """The critic's values [B, L-1] of ``rows`` before the update (0 elsewhere and off the loss tokens)."""
        values = torch.zeros_like(b.behaviour_logp)
        device = self.ranks.device
        with torch.no_grad():
            for part in self.forwards.micro_batches(b, rows):  # whole rows (shared_prompt is off with a critic)
                mb = b.select(part)
                v = critic_values(
                    self.critic, mb.input_ids.to(device), mb.attention_mask.to(device), self.forwards.packed
                ).cpu()
                values[part, : mb.loss_mask.shape[1]] = v * mb.loss_mask
        return values

    def critic_targets(self, b: Batch, rewards: torch.Tensor, old) -> None:
        """Set ``b.values`` and ``b.returns`` (the critic's targets) and, for gae and vtrace, the per-token
        ``b.advantages``. The outcome reward ``rewards`` [B] sits on each sample's last completion token
        (verl's token_level_rewards). gae: verl ``compute_gae_advantage_return`` (returns = A + V, A
        whitened over the batch's loss tokens); vtrace: the V-trace targets v_s as returns and ρ_s(r_s +
        γv_{s+1} − V(x_s)) as advantages, with ρ = π_old/μ truncated at rho_bar (c_bar in the traces),
        whitened the same way. Other estimators: the returns are the reward (γ = λ = 1 Monte-Carlo).
        Each rank computes its own samples; a sum over ranks gives every rank all of them."""
        cfg, mask = self.cfg, b.loss_mask
        mine = self.ranks.owns(b.groups)
        values = self.values(b, torch.arange(len(b.lengths))[mine])
        token_rewards = torch.zeros_like(values)
        has = mask.sum(-1) > 0
        # the outcome reward on the last token the model sampled (position t predicts token t+1): the last
        # completion token, or for a multi-turn sample ending in context, its last model token
        last = (mask * torch.arange(1, mask.shape[1] + 1, dtype=mask.dtype)).argmax(-1)
        token_rewards[has, last[has]] = rewards[has].to(values.dtype)
        if cfg.advantages.estimator == "vtrace":
            valid = mask * ~old[1]
            returns, adv = vtrace(
                token_rewards,
                values,
                (old[0] - b.behaviour_logp) * valid,
                mask,
                cfg.advantages.gamma,
                cfg.advantages.rho_bar,
                cfg.advantages.c_bar,
            )
        else:
            gamma, lam = (cfg.advantages.gamma, cfg.advantages.lam) if cfg.advantages.estimator == "gae" else (1.0, 1.0)
            adv, returns = gae(token_rewards, values, mask, gamma, lam)
        own = mine[:, None].to(values.dtype)
        values, adv, returns = values * own, adv * own * mask, returns * own * mask
        if self.ranks.world > 1:  # each sample on the one rank that trains it
            values, adv, returns = self.ranks.sum(torch.stack([values, adv, returns])).unbind(0)
        b.values, b.returns = values, returns
        if cfg.advantages.estimator in NEEDS_CRITIC:
            b.advantages = (
                (masked_whiten(adv, mask) * mask).to(b.behaviour_logp.dtype) if mask.any() else torch.zeros_like(mask)
            )
