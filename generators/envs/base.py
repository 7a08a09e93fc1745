"""The environment contract: what a multi-turn episode talks to between the model's turns.

An episode starts from a prompt row (:class:`broker.protocol.messages.PromptEntry`). The generator
samples the model's turn, hands its text to :meth:`Environment.step` and appends the environment's
reply (a tool's output, a user's next message) to the conversation as *context* tokens, which are
never trained; then it samples the next turn, until ``done`` or the episode's turn or token budget
runs out. One :class:`Environment` instance serves one episode; ``step`` may block (a tool runs, a
remote environment answers over HTTP): the generator calls it on a worker thread, so other episodes
keep sampling meanwhile.

Environments register by name (:mod:`generators.envs.registry`): the built-ins, and third-party
ones through the ``relay.envs`` entry-point group (``name = "package.module:EnvClass"``). An
environment may also live in another process or language behind the HTTP contract of docs/agents.md
(``generators.envs.remote``).

A failure is never silent: an environment that cannot go on raises :class:`EnvError` (or returns
``done`` with ``info["error"]``); the episode ends, it is counted by reason, and its sample is
marked failed (no reward invented).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from broker.protocol.messages import PromptEntry
from broker.runtime.config import StrictModel


class EnvError(RuntimeError):
    """The environment could not take a step; ``reason`` is a short code (``timeout``, ``http_500``,
    ``bad_reply``, ...) counted in the generator's metrics."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class ToolCall:
    """One tool call made in a model turn, and what came of it (for metrics and the episode record)."""

    name: str
    ok: bool
    seconds: float = 0.0
    error: str = ""  # why it failed ("unknown_tool", "bad_arguments", "timeout", "error: ...")


@dataclass
class StepResult:
    """What the environment answers to one model turn.

    reply:    the environment's message, appended to the conversation as context for the next turn
              (the generator renders it in the model's chat format as a tool or user message); None
              when the episode ends without one.
    role:     the reply's role in the conversation: ``tool`` (a tool's output) or ``user``.
    done:     the episode is over (the generator samples no further turn).
    reward:   the episode's reward when the environment scores it itself (set with ``done``); None
              to have the reward service score the final answer (the last model turn) as for
              single-turn tasks.
    tool_calls: the tool calls this turn made (counted per tool: calls, failures, latency).
    info:     free-form JSON values kept with the sample's reward details (``error`` ends the episode
              as failed).
    """

    reply: str | None
    done: bool
    role: str = "tool"
    reward: float | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


class NoOptions(StrictModel):
    """This environment takes no options."""


class Environment:
    """Base class. Subclasses set ``name`` (registered by it), optionally ``Options`` (a StrictModel
    validated when the generator starts) and implement ``reset`` and ``step``."""

    name: ClassVar[str] = ""
    Options: ClassVar[type[StrictModel]] = NoOptions

    def __init__(self, options: StrictModel | None = None):
        self.options = options if options is not None else self.Options()

    def reset(self, prompt: PromptEntry) -> None:
        """Start an episode from ``prompt`` (its text is the first user message; its reference and
        metadata are the environment's to use)."""
        raise NotImplementedError

    def step(self, turn: str) -> StepResult:
        """The model's turn ``turn`` (its text, special tokens removed) -> the environment's reply."""
        raise NotImplementedError

    def close(self) -> None:
        """The episode is over (done, failed, or its budget ran out): release what it holds."""
