"""One training step on a batch of groups: advantages, collation, micro-batches of similar length
within ``micro_batch_tokens``, log-probs under the sampling transform (learner/logprobs.py), the
off-policy-corrected loss, and one DeepSpeed optimizer step per (mini)batch, the gradients
accumulated over its micro-batches.

Exactness across micro-batches and ranks. Every rank holds the whole batch (the leader broadcasts
it) and trains the samples of its groups (group i on rank i mod ranks). So every rank computes,
without communication and before any micro-batch runs, what the whole (mini)batch on all ranks has:
the normalisers of the aggregation (loss tokens, sequences; T of seq-mean-token-sum-norm is a configured
constant), the same random
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

import logging
import time

import torch

from broker.protocol.group import sampling_transform
from learner.advantages import batch_advantages
from learner.config import NEEDS_CRITIC, LearnerConfig
from learner.correction import REJECTING
from learner.data import Batch, Forwards, collate, trained_rewards
from learner.ranks import RankShare
from learner.sequence_parallel import sequence_group
from learner.step_diagnostics import batch_diagnostics, critic_diagnostics, optimizer_step_diagnostics
from learner.step_guard import StepGuard
from learner.step_inputs import StepInputs
from learner.step_loss import MicroBatchLoss

log = logging.getLogger("relay.learner")


def old_logprobs_up_front(cfg: LearnerConfig, reference: bool, transform: tuple | None = None) -> str | None:
    """Why a step computes π_old with a forward of its own over its whole batch (this rank's share,
    without gradient) before the loss micro-batches run; None when it takes π_old from each loss
    micro-batch's own forward instead (``learner.compute.old_logprobs_from_loss``). ``reference``: a
    reference model is loaded; ``transform``: the batch's sampling transform (None at start-up, before
    any batch: the reasons that hold for every batch).

    π_old is the policy before the step's first update. With one optimizer step per batch
    (``ppo_epochs`` = ``minibatches`` = 1) those are the weights the loss forward runs with, so its
    log-probs detached are π_old and its kept set is π_old's (TRL does the same with ``num_iterations``
    = 1): the ratio r = 1 with gradient ∇ log π_θ, the correction weights π_old/μ and every diagnostic
    are the same numbers, for one forward less. The forward of its own stays where something needs π_old
    of the whole batch before the first micro-batch runs, or of weights that have moved since:

    - more than one optimizer step (``ppo_epochs`` or ``minibatches`` > 1): the later ones need the
      weights before the first;
    - a seq-mean aggregation with a correction that rejects whole sequences (``REJECTING``), or with a
      batch sampled with top-k or top-p (a sequence whose every token falls outside π_old's kept set is
      left out): the sequences left with a kept token are the denominator, fixed before the micro-batches;
    - ``kl_in_reward`` (with a reference): Σ_t KL(π_old ‖ π_ref) goes into the rewards, hence the advantages;
    - the ``vtrace`` estimator: its targets and advantages use ρ = π_old/μ.

    Not needed by the critic of ``gae`` (its targets use the values alone) nor by a seq-mean
    aggregation with a correction that keeps every sequence, under temperature alone: every sequence
    with a loss token keeps it."""
    if not cfg.compute.old_logprobs_from_loss:
        return "learner.compute.old_logprobs_from_loss is off"
    if cfg.optim.ppo_epochs * cfg.optim.minibatches > 1:
        return (
            f"{cfg.optim.ppo_epochs} epoch(s) x {cfg.optim.minibatches} minibatch(es): the later optimizer steps "
            "need the weights before the first"
        )
    if cfg.aggregation != "token-mean" and cfg.correction.mode in REJECTING:
        return (
            f"aggregation {cfg.aggregation} with correction {cfg.correction.mode}: the sequences it rejects are "
            "counted before the micro-batches run"
        )
    if cfg.aggregation != "token-mean" and transform is not None and (transform[1] > 0 or transform[2] < 1.0):
        return (
            f"aggregation {cfg.aggregation} with top-k/top-p sampling: a sequence whose every token falls "
            "outside the kept set is not counted"
        )
    if cfg.regularization.kl_in_reward and reference:
        return "kl_in_reward: the KL to the reference goes into the rewards before the loss"
    if cfg.advantages.estimator == "vtrace":
        return "vtrace: its targets and advantages use pi_old/mu"
    return None


class PolicyUpdate:
    """The trained ``engine`` (DeepSpeed), and with ``kl_coef`` > 0 a frozen ``reference`` model, with
    ``learner.critic`` the ``critic`` (a DeepSpeed engine of a learner/critic.py ValueModel), trained on
    the same micro-batches; this process is rank ``rank`` of ``world`` ranks (data-parallel, or with
    ``learner.compute.sequence_parallel`` = k, data-parallel groups of k: learner/sequence_parallel.py).

    Its collaborators: learner/step_inputs.py (π_old, the KL in the reward, the critic's targets, before
    the first update), learner/step_loss.py (the micro-batches' losses and backwards),
    learner/step_guard.py (each optimizer step taken or skipped) and learner/step_diagnostics.py."""

    def __init__(
        self, engine, cfg: LearnerConfig, pad_id: int, reference=None, rank: int = 0, world: int = 1, critic=None
    ):
        self.engine, self.cfg, self.pad_id, self.reference, self.critic = engine, cfg, pad_id, reference, critic
        self.device = engine.device
        # each group's prompt computed once for its samples (learner/logprobs.py); build_policy turns it off
        # for a model that fails its start-up check (shared_prompt below). The critic computes whole rows
        # on the policy's micro-batches: with a critic, whole rows for both. Packing (learner/packing.py)
        # takes precedence: every micro-batch one packed row, for the policy, the reference and the critic.
        # Sequence parallelism (learner/sequence_parallel.py): packed rows, each split over k ranks; the
        # data-parallel ranks are the groups of k
        k = cfg.compute.sequence_parallel
        sp = sequence_group(rank, world, k) if k > 1 else None
        self.rank, self.world = (sp.dp_rank, sp.dp) if sp else (rank, world)
        self.ranks = RankShare(self.rank, self.world, self.device, sp.dp_group if sp else None, world)
        packed = cfg.compute.packing or sp is not None
        shared = cfg.compute.shared_prompt and not packed and not cfg.compute.gradient_checkpointing and critic is None
        self.forwards = Forwards(cfg.compute.micro_batch_tokens * k, shared, packed, sp)
        self.inputs = StepInputs(engine, cfg, self.ranks, self.forwards, reference, critic)
        self.losses = MicroBatchLoss(engine, cfg, self.ranks, pad_id, self.forwards, reference, critic)
        self.guard = StepGuard(engine, critic, self.ranks)
        self.old_up_front = old_logprobs_up_front(cfg, reference is not None)  # every batch's reason, or None
        if rank == 0:
            log.info(
                "pi_old: %s",
                f"a forward of its own before the loss ({self.old_up_front})"
                if self.old_up_front
                else "each loss micro-batch's own forward, detached (one optimizer step per batch; "
                "learner.compute.old_logprobs_from_loss)"
                + (
                    ", except for a batch sampled with top-k/top-p (seq-mean)"
                    if cfg.aggregation != "token-mean"
                    else ""
                ),
            )

    def shuffle(self) -> torch.Generator:
        """The generator of this batch's random split into minibatches: the same on every rank, seeded by
        ``seed`` and the optimizer steps the engine has taken (``global_steps``, which a checkpoint saves and
        restores: learner/checkpoint.py), so a learner resumed from a checkpoint splits its next batch as the
        run that did not stop (a generator seeded once per process would start its draws again)."""
        taken = int(getattr(self.engine, "global_steps", 0))  # a stand-in engine of the unit tests: 0
        return torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + taken) % 2**63)

    @property
    def shared_prompt(self) -> bool:
        """Whether each group's prompt is computed once for its samples (learner.compute.shared_prompt)."""
        return self.forwards.shared

    @shared_prompt.setter
    def shared_prompt(self, on: bool) -> None:
        self.forwards.shared = on

    def _old_logprobs(self, b: Batch, rows: torch.Tensor, transform) -> tuple[torch.Tensor, torch.Tensor]:
        """π_old of ``rows`` (this rank's) and where its token is outside the kept set, before any update."""
        return self.inputs.old_logprobs(b, rows, transform)

    def _sequences(self, b: Batch, rows: torch.Tensor, old) -> float:
        """The samples of ``rows`` (on every rank) left with a kept token: the seq-mean modes' denominator."""
        return self.losses.sequences(b, rows, old)

    # -- one optimizer step ------------------------------------------------------------------------

    def _optimizer_step(self, b: Batch, rows: torch.Tensor, transform, old) -> dict:
        """One optimizer step on the (mini)batch ``rows`` (of every rank): this rank's micro-batches of it."""
        owner = b.groups[rows] % self.world
        plans = [
            self.forwards.micro_batches(b, rows[owner == r]) if bool((owner == r).any()) else []
            for r in range(self.world)
        ]
        norm, every = self.losses.normalisers(b, rows, old)
        acc = self.losses.run(b, plans, transform, old, norm, every)
        skipped, grad_norm = self.guard.finish(acc.loss_finite, acc.value_finite)
        diag = optimizer_step_diagnostics(
            self.ranks,
            acc,
            micro_batches=sum(len(p) for p in plans),
            tokens=norm.tokens,
            reference_kl=self.reference is not None and not self.cfg.regularization.kl_in_reward,
            critic=self.critic is not None,
        )
        diag["skipped"] = skipped
        diag["grad_norm"] = grad_norm  # None: a skipped step, or not known (StepGuard.grad_norm)
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
        """Per sample, Σ_t of the KL estimate between π_old and π_ref, and the tokens counted (StepInputs)."""
        return self.inputs.sequence_kl(b, old, transform)

    def _critic_targets(self, b: Batch, rewards: torch.Tensor, old) -> None:
        """Set the critic's values and targets on ``b`` and, for gae and vtrace, its advantages (StepInputs)."""
        self.inputs.critic_targets(b, rewards, old)

    def train_step(self, groups, sampling: dict, version: int) -> dict:
        """``ppo_epochs`` × ``minibatches`` optimizer steps on one batch (every rank gets all of it and
        trains its share). π_old is the policy at the start of the step: computed once up front where
        ``old_logprobs_up_front`` says why, else each loss micro-batch's own forward, detached."""
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
        old = (  # None: each loss micro-batch's own forward gives π_old (old_logprobs_up_front)
            self._old_logprobs(b, torch.arange(n)[self.ranks.owns(b.groups)], transform)
            if old_logprobs_up_front(self.cfg, self.reference is not None, transform)
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
        shuffle = self.shuffle()
        for _ in range(self.cfg.optim.ppo_epochs):
            split = (
                torch.randperm(n, generator=shuffle).tensor_split(self.cfg.optim.minibatches)
                if multi
                else [torch.arange(n)]
            )
            for rows in split:
                if len(rows):
                    steps.append(self._optimizer_step(b, rows, transform, old))
        diag = batch_diagnostics(steps, b, float(self.engine.get_lr()[0]), time.perf_counter() - t0)
        if kl_ref is not None:
            diag["kl_ref"] = kl_ref  # the mean per-token estimate of KL(π_old || π_ref) that went into the rewards
        if self.critic is not None:
            diag.update(critic_diagnostics(b))
        return diag
