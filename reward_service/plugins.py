"""Reward plugins: a base class, a registry with a decorator, and entry-point discovery.

A plugin scores a *batch* of items and returns one :class:`Result` per item, in order. A plugin
that cannot score an item returns ``Result.failed(reason)``: a failure is never a silent 0.
A plugin takes its options as a pydantic model (``Options``); the reward service validates them
at start-up and builds one instance per configured name.

Third-party plugins register through the ``relay.rewards`` entry-point group
(``name = "package.module:PluginClass"``). The built-ins live in :mod:`reward_service.builtin`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from broker.runtime.config import StrictModel
from broker.runtime.registry import Registry
from reward_service.httpcall import Observer  # what a plugin may report besides its results (its outbound calls)

log = logging.getLogger("relay.reward")


@dataclass
class Item:
    """One completion to score.

    prompt:     the prompt text.
    completion: the completion text (special tokens removed).
    reference:  the reference answer ("" when the task has none).
    finished:   True when the completion ended with EOS (not cut at max_tokens).
    task:       the task name; picks the plugin (unless the config routes on a metadata field).
    metadata:   anything the dataset passes through (JSON values).
    num_tokens: completion length in tokens, when the caller knows it.
    """

    prompt: str
    completion: str
    reference: str = ""
    finished: bool = True
    task: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    num_tokens: int | None = None


@dataclass
class Result:
    """score is None exactly when status is "failed"; reason says why ("code: detail", the code
    before the first colon is what the metrics count). details are named sub-scores."""

    score: float | None
    status: str = "ok"
    reason: str = ""
    details: dict[str, float] = field(default_factory=dict)

    @classmethod
    def failed(cls, reason: str) -> "Result":
        return cls(score=None, status="failed", reason=reason)


class NoOptions(StrictModel):
    """This plugin takes no options."""


class RewardPlugin:
    """Base class. Subclasses set ``Options`` (a StrictModel) when they take options and implement
    ``score`` (async, batch in, results out, same order and length). ``start``/``close`` are called
    once by the service, in its event loop, for plugins that hold connections or worker pools."""

    name: str = ""  # the registered type name
    Options: ClassVar[type[StrictModel]] = NoOptions

    def __init__(self, options: StrictModel | dict | None = None, observer: Observer | None = None):
        if options is None or isinstance(options, dict):
            options = self.Options.model_validate(options or {})
        self.options = options
        self.observer = observer or Observer()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def score(self, items: list[Item]) -> list[Result]:
        raise NotImplementedError


_PLUGINS = Registry("reward plugin", RewardPlugin, "relay.rewards")
REGISTRY: dict[str, type[RewardPlugin]] = _PLUGINS.classes
register = _PLUGINS.register
load_entry_point_plugins = _PLUGINS.load_entry_points  # register third-party plugins (``relay.rewards``)
known_plugins = _PLUGINS.known  # every plugin type: the built-ins and (loaded once) the entry-point ones


from reward_service import builtin  # noqa: E402,F401  (registers the built-ins)
