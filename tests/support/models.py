"""Helpers for tests that compare a generator's log-probs with the learner's, and the GPU mark."""

from __future__ import annotations

import pytest


def needs_gpu():
    """Mark for tests that need an NVIDIA GPU: ``gpu``, and skipped, saying why, where torch sees none."""
    import torch

    return [
        pytest.mark.gpu,
        pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"
        ),
    ]


def recompute_logprobs(
    model,
    prompt_ids: list[int],
    completion_ids: list[int],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
):
    """The learner's recomputation of a completion's per-token log-probs under ``model`` (its device
    and dtype), through the same sampling transform: what behaviour log-probs are checked against."""
    import torch

    from broker.protocol.sampling import sampling_logprobs

    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        lp = sampling_logprobs(model(ids).logits[:, :-1], temperature, top_k, top_p)
    return lp[0, len(prompt_ids) - 1 :].gather(-1, ids[0, len(prompt_ids) :, None]).squeeze(-1)
