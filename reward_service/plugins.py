"""Reward plugins: a base class, a registry with a decorator, built-ins, and entry-point discovery.

A plugin scores a *batch* of items and returns one :class:`Result` per item, in order. A plugin
that cannot score an item returns ``Result.failed(reason)``: a failure is never a silent 0.
Third-party plugins register through the ``relay.rewards`` entry-point group
(``name = "package.module:PluginClass"``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

log = logging.getLogger("relay.reward")


@dataclass
class Item:
    """One completion to score.

    prompt:     the prompt text.
    completion: the completion text (special tokens removed).
    reference:  the reference answer ("" when the task has none).
    finished:   True when the completion ended with EOS (not cut at max_tokens).
    task:       the task name; picks the plugin.
    metadata:   anything the dataset passes through.
    """

    prompt: str
    completion: str
    reference: str = ""
    finished: bool = True
    task: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    """score is None exactly when status is "failed"; reason says why."""

    score: float | None
    status: str = "ok"
    reason: str = ""
    details: dict[str, float] = field(default_factory=dict)

    @classmethod
    def failed(cls, reason: str) -> "Result":
        return cls(score=None, status="failed", reason=reason)


class RewardPlugin:
    """Base class. Subclasses set ``name`` and implement ``score`` (async, batch in, results out)."""

    name: str = ""

    async def score(self, items: list[Item]) -> list[Result]:
        raise NotImplementedError


REGISTRY: dict[str, type[RewardPlugin]] = {}


def register(name: str) -> Callable[[type[RewardPlugin]], type[RewardPlugin]]:
    def deco(cls: type[RewardPlugin]) -> type[RewardPlugin]:
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"reward plugin {name!r} is already registered by {REGISTRY[name].__qualname__}")
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return deco


def load_entry_point_plugins() -> list[str]:
    """Register third-party plugins from the ``relay.rewards`` entry-point group."""
    loaded = []
    for ep in entry_points(group="relay.rewards"):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, RewardPlugin)):
            raise TypeError(f"entry point {ep.name} = {ep.value} is not a RewardPlugin subclass")
        register(ep.name)(cls)
        loaded.append(ep.name)
    return loaded


# ----------------------------------------------------------------------------------------------
# built-ins


@register("exact_match")
class ExactMatch(RewardPlugin):
    """1.0 when the stripped completion equals the stripped reference, else 0.0."""

    async def score(self, items: list[Item]) -> list[Result]:
        return [Result(float(it.completion.strip() == it.reference.strip())) for it in items]


@register("digits")
class DigitPositions(RewardPlugin):
    """Partial credit for the toy digit tasks: 0 when the completion did not end (no EOS), else
    (positions equal to the reference) / max(len(completion), len(reference))."""

    async def score(self, items: list[Item]) -> list[Result]:
        out = []
        for it in items:
            ans, ref = it.completion.strip(), it.reference.strip()
            if not ref:
                out.append(Result.failed("no_reference"))
                continue
            if not it.finished:
                out.append(Result(0.0, details={"finished": 0.0}))
                continue
            correct = sum(a == b for a, b in zip(ans, ref))
            score = correct / max(len(ans), len(ref))
            out.append(Result(score, details={"finished": 1.0, "exact": float(ans == ref)}))
        return out
