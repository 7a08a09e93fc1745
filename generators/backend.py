"""The generator backend interface and its factory.

A backend owns one inference engine. It samples groups with per-token behaviour log-probs of the
distribution actually sampled from, and applies new weights *in place* (the engine object lives
for the whole process). ``update_weights`` raises on failure and leaves the old weights serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from generators.config import SamplingConfig


@dataclass
class Completion:
    token_ids: list[int]     # sampled tokens, EOS included when finished
    logprobs: list[float]    # behaviour log-prob of each sampled token
    finish_reason: str       # "stop" | "length"


class Backend(Protocol):
    name: str
    eos_token_id: int

    def load(self, path: str) -> None:
        """Start the engine from a weight-store snapshot folder (called once)."""

    def update_weights(self, path: str) -> None:
        """Load the weights of snapshot ``path`` into the running engine, in place."""

    def encode(self, text: str) -> list[int]:
        """Prompt text -> token ids (special tokens as the model expects)."""

    def decode(self, ids: list[int]) -> str:
        """Completion token ids -> text without special tokens."""

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seed: int) -> list[list[Completion]]:
        """For each prompt, ``sampling.n`` completions."""


def make_backend(cfg) -> Backend:
    if cfg.type == "torch":
        from generators.torch_backend import TorchBackend

        return TorchBackend(cfg)
    if cfg.type == "simulated":
        from generators.simulated_backend import SimulatedBackend

        return SimulatedBackend(cfg)
    raise ValueError(f"unknown generator backend {cfg.type!r}")
