"""Advantage estimators. Each maps a group's rewards [G] to per-sample advantages [G].

A group whose rewards are all equal gets zero advantage, never NaN.
"""

from __future__ import annotations

import torch


def grpo(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / (std + eps), std unbiased (verl ``compute_grpo_outcome_advantage``)."""
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + eps)
