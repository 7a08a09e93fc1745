"""One training step on a batch of groups: advantages, collation, micro-batches of similar length
within ``micro_batch_tokens``, log-probs under the sampling transform (learner/logprobs.py), the
off-policy-corrected loss, and one DeepSpeed optimizer step per (mini)batch, the gradients
accumulated over its micro-batches.

Exactness across micro-batches and ranks. Every rank holds the whole batch (the leader broadcasts
it) and trains the samples of its groups (group i on rank i mod ranks). So every rank computes,
without communication and before any micro-batch runs, what the whole (mini)batch on all ranks has:
the normalisers of the aggregation (loss tokens, sequences, the padded length), the same random
split into minibatches, and how many micro-batches the busiest rank runs. Each rank's loss is
multiplied by the number of ranks, because DeepSpeed averages gradients over them; diagnostics are
sums reduced over ranks (learner/diagnostics.py). DeepSpeed runs with
``managed_gradient_accumulation: false``: ``backward`` accumulates, the one ``step`` per (mini)batch
reduces and updates. ZeRO 2-3 communicate at every backward, so every rank runs the same number of
backwards: a rank with fewer micro-batches runs empty ones (a loss of 0 through every parameter).

Finite numbers only. A (mini)batch whose loss or gradient is not finite on any rank skips its
optimizer step on every rank (the ranks agree with one all-reduce): the accumulated gradients are
dropped, the weights and the optimizer state stay as they were, and ``train_step`` reports
``updates_skipped`` (of ``optimizer_steps``) and the first ``skip_reason``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import replace

import torch
import torch.distributed as dist

from broker.protocol.group import sampling_transform
from learner.advantages import batch_advantages, gae, masked_whiten, vtrace
from learner.config import NEEDS_CRITIC, LearnerConfig
from learner.correction import REJECTING, importance_weights
from learner.critic import explained_variance, value_loss
from learner.data import Batch, collate, micro_batches, trained_rewards
from learner.diagnostics import EXTREMES, merge, summarise
from learner.logprobs import TokenLogprobs, token_logprobs
from learner.losses import Normalisers, aggregate, kl_estimate, policy_loss_terms

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


class PolicyUpdate:
    """The trained ``engine`` (DeepSpeed), and with ``kl_coef`` > 0 a frozen ``reference`` model, with
    ``learner.critic`` the ``critic`` (a DeepSpeed engine of a learner/critic.py ValueModel), trained on
    the same micro-batches; this process is rank ``rank`` of ``world`` data-parallel ranks."""

    def __init__(
        self, engine, cfg: LearnerConfig, pad_id: int, reference=None, rank: int = 0, world: int = 1, critic=None
    ):
        self.engine, self.cfg, self.pad_id, self.reference, self.critic = engine, cfg, pad_id, reference, critic
        self.rank, self.world = rank, world
        self.device = engine.device
        self.shuffle = torch.Generator().manual_seed(cfg.seed)  # the minibatch split: the same on every rank

    def _reduce(self, values: dict[str, float], op=dist.ReduceOp.SUM) -> dict[str, float]:
        """``values`` summed (or ``op``) over ranks."""
        if self.world == 1 or not values:
            return values
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return dict(zip(values, t.tolist()))

    # -- forwards --------------------------------------------------------------------------------

    def _logprobs(self, model, mb: Batch, transform, entropy: bool = False) -> TokenLogprobs:
        return token_logprobs(
            model,
            mb.input_ids,
            mb.attention_mask,
            mb.loss_mask,
            transform,
            self.cfg.compute.logprob_chunk_tokens,
            entropy,
        )

    def _old_logprobs(self, b: Batch, rows: torch.Tensor, transform) -> tuple[torch.Tensor, torch.Tensor]:
        """π_old of ``rows`` (this rank's) and where its token is outside the kept set, before any update."""
        logp, outside = torch.zeros_like(b.behaviour_logp), torch.zeros_like(b.loss_mask, dtype=torch.bool)
        with torch.no_grad():
            for part in micro_batches(b.lengths, rows, self.cfg.compute.micro_batch_tokens):
                mb = b.select(part)
                lp = self._logprobs(self.engine, mb.to(self.device), transform)
                width = mb.loss_mask.shape[1]
                logp[part, :width], outside[part, :width] = lp.logp.cpu(), lp.outside.cpu()
        return logp, outside

    @staticmethod
    def _local_gradient_norm(engine) -> float | None:
        """The 2-norm of this rank's accumulated gradient of ``engine`` at ZeRO stage 0, where the gradients
        are the parameters' ``.grad`` (None at stages 1-3: the ZeRO optimizers hold theirs in partitions and
        check their norm themselves; DeepSpeed skips a step whose norm is not finite, with clipping on; the
        weights are checked before publishing, learner/publish.py)."""
        if engine.zero_optimization_stage() != 0:
            return None
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        return float(torch.stack([g.norm() for g in grads]).norm()) if grads else None

    def _grad_norm(self, engine, local: float | None) -> float | None:
        """The global gradient norm (before clipping) of the step ``engine`` just took: DeepSpeed's own
        (``get_global_grad_norm``: the ZeRO optimizers' and the bf16 optimizer's, over every rank's
        partition), else at ZeRO stage 0 in fp32, where DeepSpeed keeps none, ``local`` (the norm
        computed for the finiteness check) when this is the only rank. None when neither is known
        (stage 0 in fp32 with several ranks: each rank holds only its own share before the all-reduce)."""
        norm = engine.get_global_grad_norm()
        if norm is not None:
            return float(norm)
        return local if self.world == 1 else None

    def _skip_reason(
        self, loss_finite: bool, value_loss_finite: bool = True, norms: tuple[float | None, float | None] = (None, None)
    ) -> str | None:
        """Why every rank skips this optimizer step, of the policy and of the critic (None: take it): a
        non-finite loss or gradient norm (``norms``: this rank's, :meth:`_local_gradient_norm`) of either on
        any rank."""

        def bad(norm: float | None) -> float:
            return float(norm is not None and not math.isfinite(norm))

        flags = {"loss": float(not loss_finite), "gradient norm": bad(norms[0])}
        if self.critic is not None:
            flags.update({"value loss": float(not value_loss_finite), "critic gradient norm": bad(norms[1])})
        flags = self._reduce(flags, dist.ReduceOp.MAX)
        bad = [k for k, v in flags.items() if v]
        return f"non-finite {' and '.join(bad)}" if bad else None

    def _skip_step(self) -> None:
        for engine in (self.engine, self.critic):
            if engine is not None:
                self._drop_gradients(engine)

    @staticmethod
    def _drop_gradients(engine) -> None:
        """Drop the accumulated gradients without stepping: no weight and no optimizer moment changes, and
        the next (mini)batch accumulates from zero. At ZeRO stages 1-3 the gradients sit in the optimizer's
        partitions: they are dropped the way its own overflow path (fp16 loss scaling's skipped step) drops
        them, and its micro-step count restarts as after a step (the first backward copies, not adds)."""
        opt, stage = engine.optimizer, engine.zero_optimization_stage()
        if stage == 3:
            opt._overflow_clean_up(opt.loss_scale)
            opt._pre_step()
        elif stage in (1, 2):
            from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

            opt.zero_grad(set_to_none=True)
            opt._release_preflattened_grad_buffers()
            if opt.cpu_offload:
                opt.reset_cpu_buffers()
            else:
                for k in opt.averaged_gradients:
                    opt.averaged_gradients[k] = None
                    opt.all_grad_tensors[k] = None
            opt.micro_step_id = INITIAL_MICRO_STEP_ID
        for p in engine.module.parameters():
            p.grad = None

    def _empty_backward(self, transform) -> None:
        """A backward of a loss of 0 through every parameter: keeps this rank's ZeRO collectives in step
        with ranks that have more micro-batches."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        lp = token_logprobs(
            self.engine,
            ids,
            torch.ones_like(ids),
            torch.ones((1, 1), device=self.device),
            transform,
            self.cfg.compute.logprob_chunk_tokens,
        )
        self.engine.backward(lp.logp.sum() * 0.0)
        if self.critic is not None:
            self.critic.backward(self.critic(ids, torch.ones_like(ids)).sum() * 0.0)

    def _counts_rejected_sequences(self) -> bool:
        """The seq-mean modes leave out sequences the correction rejects whole: counting them before the
        micro-batches run needs π_old first (one more forward without gradient)."""
        return self.cfg.aggregation != "token-mean" and self.cfg.correction.mode in REJECTING

    def _sequences(self, b: Batch, rows: torch.Tensor, old) -> float:
        """The samples of ``rows`` (on every rank) left with a kept token: the seq-mean modes' denominator.
        Without π_old (one update per batch, no rejecting correction): the samples with a loss token."""
        if old is None:
            return float((b.loss_mask[rows].sum(-1) > 0).sum())
        mine = rows[b.groups[rows] % self.world == self.rank]
        valid = b.loss_mask[mine] * ~old[1][mine]
        _, keep = importance_weights(old[0][mine], b.behaviour_logp[mine], valid, self.cfg.correction)
        return self._reduce({"sequences": float((keep.sum(-1) > 0).sum())})["sequences"]

    # -- one optimizer step ------------------------------------------------------------------------

    def _optimizer_step(self, b: Batch, rows: torch.Tensor, transform, old) -> dict:
        """One optimizer step on the (mini)batch ``rows`` (of every rank): this rank's micro-batches of it."""
        cfg = self.cfg
        owner = b.groups[rows] % self.world
        plans = [
            micro_batches(b.lengths, rows[owner == r], cfg.compute.micro_batch_tokens)
            if bool((owner == r).any())
            else []
            for r in range(self.world)
        ]
        norm = Normalisers(
            float(b.loss_mask[rows].sum()),
            self._sequences(b, rows, old),
            float(b.lengths[rows].max() - 1),
            ranks=self.world,
        )
        # the entropy bonus and the KL term count every sample with a loss token, rejected or not
        every = replace(norm, sequences=float((b.loss_mask[rows].sum(-1) > 0).sum()))
        sums, totals = NO_TOKENS, Counter()
        loss_finite = value_finite = True
        for part in plans[self.rank]:
            mb = b.select(part).to(self.device)
            mask = mb.loss_mask
            lp = self._logprobs(self.engine, mb, transform, entropy=True)
            if old is None:  # one update per batch: π_old is this forward's value
                old_logp, outside = lp.logp.detach(), lp.outside
            else:
                width = mask.shape[1]
                old_logp = old[0][part, :width].to(self.device)
                outside = lp.outside | old[1][part, :width].to(self.device)
            valid = mask * ~outside
            fresh = torch.tensor([st == 0 for st in mb.staleness], device=mask.device)
            loss, s = policy_loss_terms(
                lp.logp, old_logp, mb.behaviour_logp, mb.advantages, mask, cfg, norm, valid, fresh
            )
            ent = aggregate(lp.entropy, mask, cfg.aggregation, every)
            if cfg.regularization.entropy_coef:
                loss = loss - cfg.regularization.entropy_coef * ent
            if self.reference is not None and not cfg.regularization.kl_in_reward:
                with torch.no_grad():
                    ref = self._logprobs(self.reference, mb, transform)
                both = (valid * ~ref.outside).bool()  # the estimator is defined where both log-probs are
                kl = aggregate(
                    kl_estimate(
                        torch.where(both, lp.logp, 0.0),
                        torch.where(both, ref.logp, 0.0),
                        cfg.regularization.kl_estimator,
                    ),
                    both.float(),
                    cfg.aggregation,
                    every,
                )
                loss = loss + cfg.regularization.kl_coef * kl
                totals["kl_ref"] += float(kl.detach()) / self.world
            loss_finite = loss_finite and bool(torch.isfinite(loss.detach()))
            self.engine.backward(loss)
            if self.critic is not None:  # the same micro-batch, every sample with a loss token counted
                vloss, v = value_loss(
                    self.critic(mb.input_ids, mb.attention_mask),
                    mb.values,
                    mb.returns,
                    mask,
                    cfg.critic.cliprange_value,
                    cfg.aggregation,
                    every,
                )
                value_finite = value_finite and bool(torch.isfinite(vloss.detach()))
                self.critic.backward(vloss)
                totals["value_loss"] += float(vloss.detach()) / self.world
                totals["value_clipped"] += v["clipped"]
            sums = merge(sums, s)
            totals["loss"] += float(loss.detach()) / self.world
            totals["entropy"] += float(ent.detach()) / self.world
            totals["tokens_outside_kept_set"] += float((outside & mask.bool()).sum())
            totals["padded_tokens"] += float(mb.input_ids.numel() - mb.lengths.sum())
            totals["forward_tokens"] += mb.input_ids.numel()
        for _ in range(max(len(p) for p in plans) - len(plans[self.rank])):
            self._empty_backward(transform)
        local = self._local_gradient_norm(self.engine)
        critic_norm = self._local_gradient_norm(self.critic) if self.critic is not None else None
        skipped = self._skip_reason(loss_finite, value_finite, (local, critic_norm))
        grad_norm = None
        if skipped:
            self._skip_step()
        else:
            self.engine.step()
            grad_norm = self._grad_norm(self.engine, local)
            if self.critic is not None:
                self.critic.step()
        sums = {
            **self._reduce({k: v for k, v in sums.items() if k not in EXTREMES}),
            **self._reduce({"rho_min": sums["rho_min"]}, dist.ReduceOp.MIN),
            **self._reduce({"rho_max": sums["rho_max"]}, dist.ReduceOp.MAX),
        }
        totals = self._reduce(
            {
                k: totals[k]
                for k in (
                    "loss",
                    "entropy",
                    "kl_ref",
                    "tokens_outside_kept_set",
                    "padded_tokens",
                    "forward_tokens",
                    "value_loss",
                    "value_clipped",
                )
            }
        )
        diag = summarise(sums)
        diag.update(
            loss=totals["loss"],
            entropy=totals["entropy"],
            micro_batches=sum(len(p) for p in plans),
            tokens_outside_kept_set=int(totals["tokens_outside_kept_set"]),
            padded_tokens=totals["padded_tokens"],
            forward_tokens=totals["forward_tokens"],
        )
        if self.reference is not None and not cfg.regularization.kl_in_reward:
            diag["kl_ref"] = totals["kl_ref"]
        if self.critic is not None:  # verl's critic/vf_loss and critic/vf_clipfrac
            diag.update(
                value_loss=totals["value_loss"], value_clip_frac=totals["value_clipped"] / max(norm.tokens, 1.0)
            )
        diag["skipped"] = skipped
        diag["grad_norm"] = grad_norm  # None: a skipped step, or not known (_grad_norm)
        return diag

    # -- advantages ------------------------------------------------------------------------------

    def _rewards(self, groups) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per group, the reward and the completion tokens of each sample trained on."""
        rewards, tokens = [], []
        for g in groups:
            trained = trained_rewards(g, self.cfg.batch.failed_reward, self.cfg.batch.fallback_score)
            kept = [(r, len(s.completion_ids)) for s, r in zip(g.samples, trained) if r is not None]
            rewards.append(torch.tensor([r for r, _ in kept], dtype=torch.float32))
            tokens.append(torch.tensor([n for _, n in kept]))
        return rewards, tokens

    def advantages(self, groups) -> list[torch.Tensor]:
        """Per group, the advantage of each sample trained on (``learner.advantages.estimator`` over the batch), the
        reward without a KL term."""
        return batch_advantages(self.cfg.advantages.estimator, *self._rewards(groups))

    def _kl_in_reward(self) -> bool:
        return self.cfg.regularization.kl_in_reward and self.reference is not None

    def _sequence_kl(self, b: Batch, old, transform) -> tuple[torch.Tensor, float]:
        """Per sample [B] (every rank's), Σ_t of the KL estimate between π_old and π_ref over the tokens
        where both are defined (verl ``apply_kl_penalty``'s kld, summed as the outcome estimators sum the
        token rewards), and those tokens' count."""
        kl, tokens = torch.zeros(len(b.lengths), dtype=torch.float64), 0.0
        mine = torch.arange(len(b.lengths))[b.groups % self.world == self.rank]
        with torch.no_grad():
            for part in micro_batches(b.lengths, mine, self.cfg.compute.micro_batch_tokens):
                mb = b.select(part)
                width = mb.loss_mask.shape[1]
                ref = self._logprobs(self.reference, mb.to(self.device), transform)
                both = mb.loss_mask.bool() & ~old[1][part, :width] & ~ref.outside.cpu()
                est = kl_estimate(old[0][part, :width], ref.logp.cpu(), self.cfg.regularization.kl_estimator)
                kl[part] = torch.where(both, est, 0.0).sum(-1).double()
                tokens += float(both.sum())
        if self.world > 1:
            t = torch.cat([kl, torch.tensor([tokens], dtype=torch.float64)]).to(self.device)
            dist.all_reduce(t)  # each sample is summed on the one rank that trains it
            kl, tokens = t[:-1].cpu(), float(t[-1])
        return kl, tokens

    def _values(self, b: Batch, rows: torch.Tensor) -> torch.Tensor:
        """The critic's values [B, L-1] of ``rows`` before the update (0 elsewhere and off the loss tokens)."""
        values = torch.zeros_like(b.behaviour_logp)
        with torch.no_grad():
            for part in micro_batches(b.lengths, rows, self.cfg.compute.micro_batch_tokens):
                mb = b.select(part)
                v = self.critic(mb.input_ids.to(self.device), mb.attention_mask.to(self.device)).cpu()
                values[part, : mb.loss_mask.shape[1]] = v * mb.loss_mask
        return values

    def _critic_targets(self, b: Batch, rewards: torch.Tensor, old) -> None:
        """Set ``b.values`` and ``b.returns`` (the critic's targets) and, for gae and vtrace, the per-token
        ``b.advantages``. The outcome reward ``rewards`` [B] sits on each sample's last completion token
        (verl's token_level_rewards). gae: verl ``compute_gae_advantage_return`` (returns = A + V, A
        whitened over the batch's loss tokens); vtrace: the V-trace targets v_s as returns and ρ_s(r_s +
        γv_{s+1} − V(x_s)) as advantages, with ρ = π_old/μ truncated at rho_bar (c_bar in the traces),
        whitened the same way. Other estimators: the returns are the reward (γ = λ = 1 Monte-Carlo).
        Each rank computes its own samples; a sum over ranks gives every rank all of them."""
        cfg, mask = self.cfg, b.loss_mask
        mine = b.groups % self.world == self.rank
        values = self._values(b, torch.arange(len(b.lengths))[mine])
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
        if self.world > 1:
            t = torch.stack([values, adv, returns]).to(self.device)
            dist.all_reduce(t)  # each sample on the one rank that trains it
            values, adv, returns = t.cpu().unbind(0)
        b.values, b.returns = values, returns
        if cfg.advantages.estimator in NEEDS_CRITIC:
            b.advantages = (
                (masked_whiten(adv, mask) * mask).to(b.behaviour_logp.dtype) if mask.any() else torch.zeros_like(mask)
            )

    def train_step(self, groups, sampling: dict, version: int) -> dict:
        """``ppo_epochs`` × ``minibatches`` optimizer steps on one batch (every rank gets all of it and
        trains its share). π_old is the policy at the start of the step (recomputed once when there is
        more than one update)."""
        rewards, tokens = self._rewards(groups)
        b = collate(
            groups,
            [torch.zeros(len(r)) for r in rewards],
            version,
            self.pad_id,
            self.cfg.batch.failed_reward,
            self.cfg.batch.fallback_score,
        )  # its advantages are set below, once π_old is known
        transform = sampling_transform(sampling)
        t0 = time.perf_counter()
        self.engine.train()
        n = len(b.lengths)
        multi = self.cfg.optim.ppo_epochs * self.cfg.optim.minibatches > 1
        old = (
            self._old_logprobs(b, torch.arange(n)[b.groups % self.world == self.rank], transform)
            if multi
            or self._counts_rejected_sequences()
            or self._kl_in_reward()
            or self.cfg.advantages.estimator == "vtrace"
            else None
        )
        kl_ref = None
        if self._kl_in_reward():  # verl's use_kl_in_reward: r − β Σ_t kl(π_old, π_ref), then the estimator
            kl, kl_tokens = self._sequence_kl(b, old, transform)
            kl_ref = float(kl.sum()) / max(kl_tokens, 1.0)
            rewards = [
                r - self.cfg.regularization.kl_coef * k.float()
                for r, k in zip(rewards, kl.split([len(r) for r in rewards]))
            ]
        if self.critic is not None:
            self._critic_targets(b, torch.cat(rewards), old)
        if self.cfg.advantages.estimator not in NEEDS_CRITIC:
            adv = torch.cat(batch_advantages(self.cfg.advantages.estimator, rewards, tokens))
            b.advantages = adv[:, None].to(b.advantages.dtype)
        steps = []
        for _ in range(self.cfg.optim.ppo_epochs):
            split = (
                torch.randperm(n, generator=self.shuffle).tensor_split(self.cfg.optim.minibatches)
                if multi
                else [torch.arange(n)]
            )
            for rows in split:
                if len(rows):
                    steps.append(self._optimizer_step(b, rows, transform, old))
        skipped = [d.pop("skipped") for d in steps]
        fresh = [f for f in (d.pop("mismatch_kl_fresh") for d in steps) if f is not None]
        norms = [n for n in (d.pop("grad_norm") for d in steps) if n is not None]
        diag = {k: sum(d[k] for d in steps) / len(steps) for k in steps[0]}
        diag["mismatch_kl_fresh"] = sum(fresh) / len(fresh) if fresh else None
        # the largest global gradient norm (before clipping) of the batch's optimizer steps, and the learning rate
        diag["grad_norm"] = max(norms) if norms else None
        diag["lr"] = float(self.engine.get_lr()[0])
        padded, forward = sum(d.pop("padded_tokens") for d in steps), sum(d.pop("forward_tokens") for d in steps)
        diag.update(
            ratio_min=min(d["ratio_min"] for d in steps),
            ratio_max=max(d["ratio_max"] for d in steps),
            micro_batches=sum(d["micro_batches"] for d in steps),
            tokens_outside_kept_set=sum(d["tokens_outside_kept_set"] for d in steps),
            padding_fraction=padded / forward if forward else 0.0,
            compute_s=time.perf_counter() - t0,
            samples=n,
            tokens=int(b.loss_mask.sum()),
            staleness={str(k): v for k, v in sorted(Counter(b.staleness).items())},
        )
        diag.pop("padded_tokens"), diag.pop("forward_tokens")
        # optimizer steps of this batch skipped for a non-finite loss or gradient (and the first reason, when any)
        diag.update(updates_skipped=sum(s is not None for s in skipped), optimizer_steps=len(steps))
        if diag["updates_skipped"]:
            diag["skip_reason"] = next(s for s in skipped if s)
        if kl_ref is not None:
            diag["kl_ref"] = kl_ref  # the mean per-token estimate of KL(π_old || π_ref) that went into the rewards
        if self.critic is not None:  # of the values before this step's update (verl's critic/* metrics)
            m = b.loss_mask.bool()
            diag.update(
                explained_variance=explained_variance(b.returns, b.values, b.loss_mask),
                values_mean=float(b.values[m].mean()) if m.any() else 0.0,
                returns_mean=float(b.returns[m].mean()) if m.any() else 0.0,
            )
        return diag
