"""One training step on a batch of groups: advantages, collation, the forward under the sampling
transform, the off-policy-corrected loss, DeepSpeed's backward and step."""

from __future__ import annotations

import time
from collections import Counter

import torch

from broker.protocol.group import sampling_transform
from broker.protocol.sampling import sampling_logprobs
from learner.advantages import GROUP_ESTIMATORS
from learner.config import LearnerConfig
from learner.data import collate, trained_rewards
from learner.losses import aggregate, compute_policy_loss, kl_estimate


class PolicyUpdate:
    """The trained ``engine`` (DeepSpeed), and with ``kl_coef`` > 0 a frozen ``reference`` model."""

    def __init__(self, engine, cfg: LearnerConfig, pad_id: int, reference=None):
        self.engine, self.cfg, self.pad_id, self.reference = engine, cfg, pad_id, reference
        self.advantage_fn = GROUP_ESTIMATORS[cfg.advantage]

    def _logp(self, b, rows, sampling: dict, model=None, entropy: bool = False):
        """Log-probs [rows, L-1] of each next token under the sampling transform (0 off-completion),
        of the trained engine or another ``model``; with ``entropy`` also the distribution's entropy."""
        temperature, top_k, top_p = sampling_transform(sampling)
        model = model if model is not None else self.engine
        logits = model(input_ids=b.input_ids[rows], attention_mask=b.attention_mask[rows]).logits[:, :-1]
        all_logp = sampling_logprobs(logits, temperature, top_k, top_p)
        logp = all_logp.gather(-1, b.input_ids[rows, 1:, None]).squeeze(-1)
        logp = torch.where(b.loss_mask[rows].bool(), logp, torch.zeros_like(logp))
        if not entropy:
            return logp
        p = all_logp.exp()
        return logp, -torch.where(p > 0, p * all_logp, torch.zeros_like(p)).sum(-1)

    def train_step(self, groups, sampling: dict, version: int) -> dict:
        """``ppo_epochs`` × ``minibatches`` optimizer steps on one batch. π_old is the policy at the
        start of the step (recomputed once when there is more than one update)."""
        advs = []
        for g in groups:
            kept = [r for r in trained_rewards(g, self.cfg.failed_reward, self.cfg.fallback_score) if r is not None]
            advs.append(self.advantage_fn(torch.tensor(kept, dtype=torch.float32)))
        b = collate(groups, advs, version, self.pad_id, self.cfg.failed_reward, self.cfg.fallback_score)
        t0 = time.perf_counter()
        self.engine.train()
        n = b.input_ids.shape[0]
        every = torch.arange(n)
        multi = self.cfg.ppo_epochs * self.cfg.minibatches > 1
        old_logp = None
        if multi:
            with torch.no_grad():
                old_logp = self._logp(b, every, sampling)
        diags, losses = [], []
        for _ in range(self.cfg.ppo_epochs):
            for rows in torch.randperm(n).chunk(self.cfg.minibatches) if multi else [every]:
                mask = b.loss_mask[rows]
                logp, ent = self._logp(b, rows, sampling, entropy=True)
                old = old_logp[rows] if multi else logp.detach()
                loss, diag = compute_policy_loss(logp, old, b.behaviour_logp[rows], b.advantages[rows],
                                                 mask, self.cfg)
                agg = self.cfg.aggregation
                diag["entropy"] = float(aggregate(ent.detach(), mask, agg))
                if self.cfg.entropy_coef:
                    loss = loss - self.cfg.entropy_coef * aggregate(ent, mask, agg)
                if self.reference is not None:
                    with torch.no_grad():
                        ref_logp = self._logp(b, rows, sampling, model=self.reference)
                    kl = aggregate(kl_estimate(logp, ref_logp, self.cfg.kl_estimator), mask, agg)
                    loss = loss + self.cfg.kl_coef * kl
                    diag["kl_ref"] = float(kl)
                self.engine.backward(loss)
                self.engine.step()
                diags.append(diag)
                losses.append(float(loss))
        diag = {k: sum(d[k] for d in diags) / len(diags) for k in diags[0]}
        diag.update(ratio_min=min(d["ratio_min"] for d in diags), ratio_max=max(d["ratio_max"] for d in diags))
        diag.update(loss=sum(losses) / len(losses), compute_s=time.perf_counter() - t0, samples=n,
                    tokens=int(b.loss_mask.sum()), staleness=dict(sorted(Counter(b.staleness).items())))
        return diag
