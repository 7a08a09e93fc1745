"""``remote``: an environment behind HTTP, in any language or container (contract in docs/agents.md).

    POST {url}/reset  {"episode_id": str, "prompt": {"text", "reference", "task", "metadata"}}
                      -> {"ok": true}
    POST {url}/step   {"episode_id": str, "index": int, "turn": str}
                      -> {"reply": str | null, "done": bool, "role": "tool" | "user", "reward": float | null,
                          "tool_calls": [{"name": str, "ok": bool, "error": str}], "info": {}}
    POST {url}/close  {"episode_id": str}  -> anything (the reply is not read)

``index`` is the turn's number in the episode (0, 1, ...): a step retried after a timeout or a 5xx
repeats it, so a server can answer a repeated index with its earlier reply instead of applying the
turn twice. A bearer token (``token_env`` / ``token``) is sent as ``Authorization: Bearer ...``.

The calls are :class:`reward_service.httpcall.HttpCaller`'s, as for remote rewards: a timeout per
attempt, retries with back-off and jitter on timeouts, connection errors, 5xx and 429, and a circuit
breaker, shared by every episode of one environment config (one factory). They run on one event-loop
thread of the factory's; ``step`` (called on a generator's worker thread) waits for its call.

Every failure is an :class:`~generators.envs.base.EnvError` whose reason is counted: ``timeout``,
``unreachable``, ``http_<status>`` (after the retries for 5xx), ``bad_reply`` (not JSON, or not the
shape above), ``circuit_open`` (the server failed ``breaker_failures`` times in a row: left alone for
``breaker_reset_s``, then one trial request). The generator ends that episode as failed and goes on.
A failed ``/close`` is counted (``close_failed``) and not raised: the episode is over anyway. Calls
in flight when the factory is closed (the generator stops) end at once with ``closed``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import uuid
from collections import Counter
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pydantic import Field

from broker.protocol.group import REWARD_LIMIT
from generators.envs.base import Environment, EnvError, StepResult, ToolCall
from generators.envs.registry import register_env
from reward_service.httpcall import CallFailed, HttpCaller, HttpOptions, Observer

log = logging.getLogger("relay.generator")


class RemoteEnvOptions(HttpOptions):
    """An environment server speaking the contract of docs/agents.md."""

    url: str = Field(
        description="the server's base URL; /reset, /step and /close are appended (e.g. http://127.0.0.1:9100)",
        pattern=r"^https?://",
    )
    timeout_s: float = Field(10.0, gt=0, le=3600, description="timeout of one attempt (connect + read)")
    max_concurrency: int = Field(
        16, ge=1, le=1024, description="requests in flight to the server at most, all episodes together"
    )


class RemoteStats(Observer):
    """Counters of one remote environment config: requests by outcome (HttpCaller's observer), episode
    errors by reason, the circuit breaker's state."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()
        self.errors: Counter = Counter()
        self.circuit_state = "closed"
        self.episodes = 0

    # the HttpCaller observer interface (reward_service.httpcall.Observer)
    def request(self, outcome: str) -> None:
        with self.lock:
            self.requests[outcome] += 1

    def circuit(self, state: str) -> None:
        with self.lock:
            self.circuit_state = state

    def error(self, reason: str) -> None:
        with self.lock:
            self.errors[reason] += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": dict(self.requests),
                "errors": dict(self.errors),
                "circuit": self.circuit_state,
                "episodes": self.episodes,
            }


class RemoteShared:
    """One HTTP client, circuit breaker and event-loop thread for all episodes of one config."""

    def __init__(self, options: RemoteEnvOptions):
        self.options = options
        self.counters = RemoteStats()
        self.http = HttpCaller(options.url.rstrip("/"), options, self.counters)  # token checked here
        o = options
        self.longest_call_s = (o.retries + 1) * o.timeout_s + o.retries * o.backoff_max_s + 30.0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="relay-remote-env", daemon=True)
        self.thread.start()
        # closed under this lock: a call either starts before close() (and is cancelled by it) or is refused
        # (one that reached the loop after its shutdown would wait longest_call_s for a loop that never runs it)
        self.lock = threading.Lock()
        self.closed = False

    def post(self, path: str, payload: dict[str, Any], count: bool = True) -> Any:
        """POST on the loop thread; the JSON reply, or EnvError(reason) (counted unless ``count`` is False)."""
        with self.lock:
            if self.closed:
                raise EnvError("closed", "the remote environment's client is closed")
            future = asyncio.run_coroutine_threadsafe(self.http.post_json(payload, path), self.loop)
        try:
            return future.result(timeout=self.longest_call_s)
        except FutureTimeout:  # cannot happen unless the loop thread is stuck: never wait forever
            future.cancel()
            raise self.fail("timeout", f"{path}: no outcome within {self.longest_call_s:.0f}s") from None
        except CancelledError:
            raise EnvError("closed", "the remote environment's client was closed during the call") from None
        except CallFailed as e:
            reason = "bad_reply" if e.code == "malformed" else e.code
            if not count:
                raise EnvError(reason, f"{path}: {e.detail}"[:300]) from None
            raise self.fail(reason, f"{path}: {e.detail}"[:300]) from None

    def fail(self, reason: str, detail: str) -> EnvError:
        self.counters.error(reason)
        return EnvError(reason, detail)

    def stats(self) -> dict[str, Any]:
        return self.counters.snapshot()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True  # calls scheduled before this are on the loop before shutdown() is

        async def shutdown():
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for task in tasks:  # calls in flight end as EnvError("closed") in their episodes
                task.cancel()
            # a cancelled call unwinds through the HTTP client over several turns of the loop: let it finish
            # (its episode then sees "closed") before the loop stops, or its episode would wait longest_call_s
            if tasks:
                await asyncio.wait(tasks, timeout=5)
            await self.http.close()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def _finite_or_none(v, what: str):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number or null, not {str(v)[:40]!r}")
    return float(v)


def parse_step_reply(data: Any) -> StepResult:
    """A /step reply checked against the contract (ValueError saying what is wrong)."""
    if not isinstance(data, dict):
        raise ValueError("the reply is not a JSON object")
    done = data.get("done")
    if not isinstance(done, bool):
        raise ValueError("'done' must be true or false")
    reply = data.get("reply")
    if reply is not None and not isinstance(reply, str):
        raise ValueError("'reply' must be a string or null")
    if not done and reply is None:
        raise ValueError("'reply' is required while the episode is not done")
    role = data.get("role", "tool")
    if role not in ("tool", "user"):
        raise ValueError(f"'role' must be 'tool' or 'user', not {str(role)[:20]!r}")
    reward = _finite_or_none(data.get("reward"), "'reward'")
    if reward is not None and abs(reward) > REWARD_LIMIT:  # the group message's bound (docs/protocol.md 3.2)
        raise ValueError(f"'reward' {reward:g} is outside [-{REWARD_LIMIT:g}, {REWARD_LIMIT:g}]")
    info = data.get("info", {})
    if not isinstance(info, dict):
        raise ValueError("'info' must be an object")
    calls = data.get("tool_calls", [])
    if not isinstance(calls, list):
        raise ValueError("'tool_calls' must be a list")
    records = []
    for i, c in enumerate(calls):
        if not (
            isinstance(c, dict)
            and isinstance(c.get("name"), str)
            and isinstance(c.get("ok"), bool)
            and isinstance(c.get("error", ""), str)
        ):
            raise ValueError(f'tool_calls[{i}] must be {{"name": str, "ok": bool, "error": str}}')
        records.append(
            ToolCall(
                c["name"][:64],
                c["ok"],
                float(_finite_or_none(c.get("seconds"), "seconds") or 0.0),
                c.get("error", "")[:300],
            )
        )
    return StepResult(reply=reply, done=done, role=role, reward=reward if done else None, tool_calls=records, info=info)


@register_env("remote")
class RemoteEnv(Environment):
    Options = RemoteEnvOptions
    Shared = RemoteShared

    def __init__(self, options=None, shared: RemoteShared | None = None):
        super().__init__(options)
        self.shared = shared if shared is not None else self.Shared(self.options)
        self.episode_id = ""
        self.index = 0

    def reset(self, prompt) -> None:
        self.episode_id = uuid.uuid4().hex
        self.index = 0
        with self.shared.counters.lock:
            self.shared.counters.episodes += 1
        reply = self.shared.post(
            "/reset",
            {
                "episode_id": self.episode_id,
                "prompt": {
                    "text": prompt.text,
                    "reference": prompt.reference,
                    "task": prompt.task,
                    "metadata": prompt.metadata,
                },
            },
        )
        if not (isinstance(reply, dict) and reply.get("ok") is True):
            raise self.shared.fail("bad_reply", f'/reset answered {str(reply)[:100]!r}, not {{"ok": true}}')

    def step(self, turn: str) -> StepResult:
        data = self.shared.post("/step", {"episode_id": self.episode_id, "index": self.index, "turn": turn})
        self.index += 1
        try:
            return parse_step_reply(data)
        except ValueError as e:
            raise self.shared.fail("bad_reply", f"/step: {e}") from None

    def close(self) -> None:
        if not self.episode_id:
            return
        try:
            self.shared.post("/close", {"episode_id": self.episode_id}, count=False)
        except EnvError as e:
            self.shared.counters.error("close_failed")
            log.warning("remote environment: /close of episode %s failed: %s", self.episode_id, e)
        self.episode_id = ""
