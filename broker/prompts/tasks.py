"""Built-in verifiable toy tasks: prompt generators whose answers a reward plugin can check.

A task yields prompts ``{"text": "...", "reference": "...", "task": name}``. The matching reward
plugin in the reward service scores a completion against ``reference``. Prompts are plain text in
the 15-symbol alphabet of the built-in tiny model (digits, ``+``, ``=``); any tokenizer can
encode them.

  copy     "473="  -> "473"   (copy the digits)
  reverse  "473="  -> "374"   (reverse them)
  add      "12+7=" -> "19"    (add two numbers)
  calc     "7*8="  -> "56"    (multi-turn: call the calculator tool, then answer from its result)

A task may need more than a reward plugin: :data:`TASK_NEEDS` says which environment runs its
episodes (generators/envs) and whether the tiny model needs its tool vocabulary; ``relay up``
wires both from it. ``calc``'s operands have ``min_digits`` .. ``max_digits`` digits; its default is
one digit (:func:`task_defaults`), so the tiny model learns the tool protocol quickly.
"""

from __future__ import annotations

import random
from typing import Callable, Iterator

from pydantic import Field

from broker.protocol.messages import PromptEntry
from broker.runtime.config import StrictModel


class TaskConfig(StrictModel):
    """Which built-in task feeds prompts, and its size."""

    name: str = Field("copy", description="built-in task: " + ", ".join(("copy", "reverse", "add", "calc")))
    min_digits: int = Field(3, ge=1, le=20, description="shortest digit string in a prompt")
    max_digits: int = Field(
        3,
        ge=1,
        le=20,
        description="longest digit string in a prompt (variable lengths are "
        "much harder for the built-in tiny model: see docs/off-policy.md)",
    )
    seed: int = Field(0, description="seed of the prompt generator")


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))


def _copy(rng: random.Random, cfg: TaskConfig) -> PromptEntry:
    d = _digits(rng, cfg.min_digits, cfg.max_digits)
    return PromptEntry(d + "=", d, "copy")


def _reverse(rng: random.Random, cfg: TaskConfig) -> PromptEntry:
    d = _digits(rng, cfg.min_digits, cfg.max_digits)
    return PromptEntry(d + "=", d[::-1], "reverse")


def _calc(rng: random.Random, cfg: TaskConfig) -> PromptEntry:
    a, b = _digits(rng, cfg.min_digits, cfg.max_digits), _digits(rng, cfg.min_digits, cfg.max_digits)
    return PromptEntry(f"{int(a)}*{int(b)}=", str(int(a) * int(b)), "calc")


def _add(rng: random.Random, cfg: TaskConfig) -> PromptEntry:
    a, b = _digits(rng, cfg.min_digits, cfg.max_digits), _digits(rng, cfg.min_digits, cfg.max_digits)
    return PromptEntry(f"{int(a)}+{int(b)}=", str(int(a) + int(b)), "add")


TASKS: dict[str, Callable[[random.Random, TaskConfig], PromptEntry]] = {
    "copy": _copy,
    "reverse": _reverse,
    "add": _add,
    "calc": _calc,
}

# what a task needs beyond a reward plugin: the environment that runs its episodes (generator.episodes.env) and
# the tiny model's tool vocabulary (learner.tiny.tools); tasks not listed are single-turn
TASK_NEEDS: dict[str, dict] = {
    "calc": {"env": "calc", "tools": True},
}

# a task's own defaults for task.min_digits / max_digits where the general ones do not suit it
TASK_DIGITS: dict[str, tuple[int, int]] = {"calc": (1, 1)}


def task_defaults(name: str) -> dict:
    """The ``task`` section's defaults for task ``name`` (its digits), below anything configured."""
    lo_hi = TASK_DIGITS.get(name)
    return {"min_digits": lo_hi[0], "max_digits": lo_hi[1]} if lo_hi else {}


class UnknownTaskError(ValueError):
    pass


def check_task(name: str) -> None:
    if name not in TASKS:
        raise UnknownTaskError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")


def prompt_stream(cfg: TaskConfig) -> Iterator[PromptEntry]:
    """An endless, seeded stream of prompts of the configured task."""
    check_task(cfg.name)
    if cfg.min_digits > cfg.max_digits:
        raise ValueError(f"task.min_digits ({cfg.min_digits}) > task.max_digits ({cfg.max_digits})")
    rng = random.Random(cfg.seed)
    make = TASKS[cfg.name]
    while True:
        yield make(rng, cfg)


def longest_prompt_tokens(cfg: TaskConfig, sample: int = 256) -> int:
    """A bound on the task's prompt tokens: the longest of its first ``sample`` prompts in characters, plus
    the special tokens (at most a token each; the prompts are ASCII: no tokenizer makes more tokens than
    characters)."""
    import itertools

    return max(len(p.text) for p in itertools.islice(prompt_stream(cfg), sample)) + 2


class TaskSource:
    """The task's prompts from any position (``fed`` prompts in): the same interface as
    :class:`broker.prompts.datasets.DatasetSource`, so the feeder resumes a built-in task where it was too.
    Resuming replays the seeded generator up to the position (cheap: ~1 µs per prompt)."""

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self._stream = prompt_stream(cfg)
        self._at = 0

    def exhausted(self, pos) -> bool:
        return False

    def take(self, k: int, pos):
        from broker.prompts.datasets import Position

        if pos.fed < self._at:
            self._stream, self._at = prompt_stream(self.cfg), 0
        while self._at < pos.fed:
            next(self._stream)
            self._at += 1
        out = []
        for _ in range(k):
            p = next(self._stream)
            out.append((0, self._at, p))
            self._at += 1
        return out, Position(0, self._at, self._at, 0)
