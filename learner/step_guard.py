"""Take or skip one optimizer step, finite numbers only (learner/update.py).

A (mini)batch whose loss or gradient is not finite on any rank skips its optimizer step on every rank
(the ranks agree with one all-reduce): the accumulated gradients are dropped, the weights and the
optimizer state stay as they were. A step taken reports the global gradient norm before clipping.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from learner.ranks import RankShare


def local_gradient_norm(engine) -> float | None:
    """The 2-norm of this rank's accumulated gradient of ``engine`` at ZeRO stage 0, where the gradients
    are the parameters' ``.grad`` (None at stages 1-3: the ZeRO optimizers hold theirs in partitions and
    check their norm themselves; DeepSpeed skips a step whose norm is not finite, with clipping on; the
    weights are checked before publishing, learner/publish.py)."""
    if engine.zero_optimization_stage() != 0:
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.stack([g.norm() for g in grads]).norm()) if grads else None


def drop_gradients(engine) -> None:
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


class StepGuard:
    """The optimizer steps of the policy ``engine`` and, when there is one, the ``critic`` engine, taken
    together or skipped together on every rank of ``ranks``."""

    def __init__(self, engine, critic, ranks: RankShare):
        self.engine, self.critic, self.ranks = engine, critic, ranks

    def finish(self, loss_finite: bool, value_finite: bool) -> tuple[str | None, float | None]:
        """Step both engines on the gradients their micro-batches accumulated, or drop them: the reason
        of a skip (None: taken) and the policy's gradient norm (None: skipped, or not known)."""
        local = local_gradient_norm(self.engine)
        critic_norm = local_gradient_norm(self.critic) if self.critic is not None else None
        skipped = self.skip_reason(loss_finite, value_finite, (local, critic_norm))
        grad_norm = None
        if skipped:
            for engine in (self.engine, self.critic):
                if engine is not None:
                    drop_gradients(engine)
        else:
            self.engine.step()
            grad_norm = self.grad_norm(local)
            if self.critic is not None:
                self.critic.step()
        return skipped, grad_norm

    def grad_norm(self, local: float | None) -> float | None:
        """The global gradient norm (before clipping) of the step the policy engine just took: DeepSpeed's
        own (``get_global_grad_norm``: the ZeRO optimizers' and the bf16 optimizer's, over every rank's
        partition), else at ZeRO stage 0 in fp32, where DeepSpeed keeps none, ``local`` (the norm
        computed for the finiteness check) when this is the only rank. None when neither is known
        (stage 0 in fp32 with several ranks: each rank holds only its own share before the all-reduce)."""
        norm = self.engine.get_global_grad_norm()
        if norm is not None:
            return float(norm)
        return local if self.ranks.scale == 1 else None

    def skip_reason(
        self, loss_finite: bool, value_loss_finite: bool = True, norms: tuple[float | None, float | None] = (None, None)
    ) -> str | None:
        """Why every rank skips this optimizer step, of the policy and of the critic (None: take it): a
        non-finite loss or gradient norm (``norms``: this rank's, :func:`local_gradient_norm`) of either on
        any rank."""

        def bad(norm: float | None) -> float:
            return float(norm is not None and not math.isfinite(norm))

        flags = {"loss": float(not loss_finite), "gradient norm": bad(norms[0])}
        if self.critic is not None:
            flags.update({"value loss": float(not value_loss_finite), "critic gradient norm": bad(norms[1])})
        flags = self.ranks.everywhere(flags, dist.ReduceOp.MAX)
        bad = [k for k, v in flags.items() if v]
        return f"non-finite {' and '.join(bad)}" if bad else None
