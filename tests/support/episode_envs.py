"""A small environment for the episode runner's tests (until and besides the built-in ones).

``CountEnv``: every model turn is answered by a "count" tool call whose reply is the number of turns
so far (``"1"``, ``"2"``, ...); the episode ends after ``done_after`` turns with reward 1.0 when the
last turn's text equals the prompt's reference, else 0.0. Its behaviour can be steered per prompt
through the prompt's metadata: ``sleep_s`` (each step sleeps), ``fail_at`` (the step of that turn
raises :class:`EnvError` ``("http_500")``), ``crash_at`` (raises a ValueError, a plugin's bug),
``fail_reset`` (reset raises), ``never_done`` (the episode only ends by a budget). Every call is
logged with its time in ``CountEnv.log`` (class-wide, for the tests to read).
"""

from __future__ import annotations

import threading
import time

from broker.protocol.messages import PromptEntry
from generators.envs.base import EnvError, Environment, StepResult, ToolCall


class CountEnv(Environment):
    name = "count"
    log: list[tuple[str, str, float]] = []  # (event, prompt text, monotonic time)
    _lock = threading.Lock()

    def __init__(self, done_after: int = 2):
        super().__init__()
        self.done_after = done_after
        self.turns = 0
        self.prompt: PromptEntry | None = None
        self.closed = False

    def _record(self, event: str) -> None:
        with self._lock:
            CountEnv.log.append((event, self.prompt.text if self.prompt else "", time.monotonic()))

    def reset(self, prompt: PromptEntry) -> None:
        self.prompt = prompt
        self._record("reset")
        if prompt.metadata.get("fail_reset"):
            raise EnvError("bad_prompt", "this prompt cannot start an episode")

    def step(self, turn: str) -> StepResult:
        self.turns += 1
        meta = self.prompt.metadata
        self._record(f"step{self.turns}-start")
        time.sleep(float(meta.get("sleep_s", 0)))
        self._record(f"step{self.turns}-end")
        if meta.get("fail_at") == self.turns:
            raise EnvError("http_500", "the environment's server failed")
        if meta.get("crash_at") == self.turns:
            raise ValueError("a bug in the plugin")
        call = [ToolCall("count", ok=not meta.get("tool_fails"), seconds=0.0)]
        if self.turns >= self.done_after and not meta.get("never_done"):
            return StepResult(None, True, reward=float(turn == self.prompt.reference), tool_calls=call)
        return StepResult(str(self.turns), False, role="tool", tool_calls=call)

    def close(self) -> None:
        self.closed = True
