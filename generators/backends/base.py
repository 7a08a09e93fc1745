"""The generator backend interface (each backend is built by its config's ``build()``).

A backend owns one inference engine. It samples groups with per-token behaviour log-probs of the
distribution actually sampled from, and applies new weights *in place* (the engine object lives
for the whole process). ``update_weights`` raises on failure and leaves the old weights serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from generators.config import SamplingConfig


@dataclass
class Completion:
    token_ids: list[int]  # sampled tokens, EOS included when finished
    logprobs: list[float]  # behaviour log-prob of each sampled token
    finish_reason: str  # "stop" | "length"
    versions: list[int] | None = None  # weight version that sampled each token (None: the batch's version)
    # multi-turn episodes (generators/episodes.py): 1 for a token the model sampled, 0 for a context token
    # (a tool's output, the chat template's turn markers) inserted between turns; None: all sampled
    trainable: list[int] | None = None
    env_reward: float | None = None  # the episode's reward when its environment scored it (None: the reward service)
    answer_ids: list[int] | None = None  # the final model turn's tokens, scored by the reward service (None: all)
    episode: dict | None = None  # what the episode did (turns, tool calls, failures), kept with the reward details


# Called by a backend between decode steps when the generator's in-flight policy is "continue": the
# generator may apply a newer weight version right there (through ``update_weights``) and returns
# the version serving from now on; the backend stamps every later token with it.
StepHook = Callable[[], int]


def _nothing() -> None:
    return None


class HFText:
    """encode/decode through a Hugging Face tokenizer in ``self.tokenizer`` (set by ``load``), and the
    ``alive`` hook a backend calls once per engine or decode step (the generator sets it to send a
    heartbeat, at most one per heartbeat_s: a long batch is busy, not hung; relay up's --hang-after)."""

    tokenizer = None
    alive = staticmethod(_nothing)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Backend(Protocol):
    name: str
    eos_token_id: int
    supports_in_flight: bool  # generate() honours on_step (the "continue" in-flight policy); its config's ClassVar
    alive: Callable[[], None]  # called by generate() once per engine/decode step (set by the generator: a heartbeat)

    def load(self, path: str) -> None:
        """Start the engine from a weight-store snapshot folder (called once)."""

    def update_weights(self, path: str) -> None:
        """Load the weights of snapshot ``path`` into the running engine, in place."""

    def encode(self, text: str) -> list[int]:
        """Prompt text -> token ids (special tokens as the model expects)."""

    def decode(self, ids: list[int]) -> str:
        """Completion token ids -> text without special tokens."""

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, on_step: StepHook | None = None
    ) -> list[list[Completion]]:
        """For each prompt, ``sampling.n`` completions. With ``on_step``, call it between decode
        steps and fill ``Completion.versions``."""
