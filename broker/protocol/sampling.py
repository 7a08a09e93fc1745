"""The sampling transform, shared by generators and learner (imports torch; the broker service
itself never imports this module).

Behaviour log-probs are defined as log-probabilities under the distribution actually sampled
from: logits / temperature, then top-k, then top-p (nucleus) truncation, renormalised. The learner
recomputes π_old and π_θ through this same function, so ratios compare like with like.
"""

from __future__ import annotations

import torch


def sampling_logprobs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """log-softmax of the sampling distribution over the last dimension (-inf outside the kept set)."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass of the tokens before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)
