"""Batches and comparisons shared by the learner's exactness tests (shared prompts, packing, π_old from
the loss forward): each compares two ways of computing the same step on the same inputs."""

from __future__ import annotations

import numpy as np
import torch

from broker.protocol.group import Sample
from learner.logprobs import token_logprobs
from tests.support.data import make_group


def mixed_groups(sampling: dict) -> list:
    """Three groups of 3 samples, prompts of 2-6 tokens, completions of 1-7, behaviour log-probs off the
    learner's (so the correction weights are not 1)."""
    rng = np.random.default_rng(3)

    def sample(t):
        return Sample(
            rng.integers(3, 13, t).astype(np.int32),
            -rng.uniform(0.1, 3.0, t).astype(np.float32),
            [[0, t]],
            "stop",
            float(rng.random()),
        )

    return [
        make_group(samples=[sample(t) for t in lens], prompt_ids=np.array(prompt, np.int32), sampling=sampling)
        for prompt, lens in (([1, 4, 14], (3, 6, 1)), ([1, 5, 7, 9, 3, 14], (2, 5, 4)), ([1, 14], (7, 2, 3)))
    ]


def logprobs_and_grads(model, ids, attn, positions, transform, **path):
    """Log-probs (with entropy) of one forward path (``path``: token_logprobs' ``shared`` or ``packed``) and
    the gradients of a policy-gradient loss with an entropy bonus on them."""
    adv = torch.linspace(-1.0, 1.0, len(ids))[:, None]
    model.zero_grad()
    lp = token_logprobs(model, ids, attn, positions, transform, 4, entropy=True, **path)
    m = positions * ~lp.outside
    (-(lp.logp * adv * m).sum() - 0.1 * (lp.entropy * positions).sum()).backward()
    return lp, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
