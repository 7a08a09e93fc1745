"""``tools``: the tool-calling environment.

Each model turn is parsed for tool calls (:mod:`generators.tool_calls`: Hermes/Qwen JSON or the
tiny model's compact form). A turn with calls gets them run, concurrently on a thread pool shared by
the environment's episodes, each bounded by its tool's timeout, and the reply (role ``tool``) is
their outputs, one a line in the calls' order (``error: ...`` for a failed call); the episode goes
on. A turn without a call is the final answer: ``done``, reward None (the reward service scores it
as for a single-turn task).

Failed calls are the model's mistakes, answered and counted, never exceptions: unreadable
(``bad_json``, ``bad_call``, ``empty``, ``unclosed``), ``unknown_tool``, ``bad_arguments``,
``too_many_calls`` (over ``max_calls_per_turn``: not run), ``timeout``, and the tool's own codes.

A call that times out is answered ``timeout`` at once; its thread finishes in the background (the
calculator is bounded in size, the python tool's sandbox is killed at the same timeout).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal

from pydantic import Field, model_validator

from broker.runtime.config import StrictModel
from generators.envs.base import Environment, StepResult, ToolCall
from generators.envs.registry import register_env
from generators.tool_calls import ParsedCall, parse_tool_calls
from generators.envs.tools import BUILTIN_TOOLS, Tool, calculator_tool, python_tool, run_tool

GRACE_S = 0.5  # waited past a tool's timeout, so a tool that enforces its own (python) reports it with its output


class ToolEnvOptions(StrictModel):
    """The tool-calling environment."""

    tools: list[str] = Field(
        default_factory=lambda: ["calculator", "python"],
        description=f"the tools offered, among {sorted(BUILTIN_TOOLS)}",
        min_length=1,
    )
    default_tool: str = Field(
        "", description="the tool a compact call (<tool_call>EXPR</tool_call>) means; default: the first of `tools`"
    )
    max_calls_per_turn: int = Field(
        4, ge=1, le=64, description="tool calls run per turn; more are answered too_many_calls"
    )
    timeout_s: dict[str, float] = Field(
        default_factory=dict,
        description="seconds one call of a tool may take, by tool name (default: calculator 1, python 10)",
    )
    python_memory_mb: int = Field(256, ge=32, le=65536, description="memory of one python call's program")
    python_isolation: Literal["cgroup", "rlimits"] = Field(
        "cgroup",
        description="the python tool's sandbox limits, as code_exec's `isolation`: \"cgroup\" (one "
        'cgroup per call) or "rlimits" (per-process limits only, weaker)',
    )
    threads: int = Field(16, ge=1, le=1024, description="tool calls running at once, all episodes together")

    @model_validator(mode="after")
    def _known(self):
        unknown = [t for t in self.tools if t not in BUILTIN_TOOLS]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; valid: {sorted(BUILTIN_TOOLS)}")
        if len(set(self.tools)) != len(self.tools):
            raise ValueError(f"tools listed twice: {self.tools}")
        if self.default_tool and self.default_tool not in self.tools:
            raise ValueError(f"default_tool {self.default_tool!r} is not among tools {self.tools}")
        bad = [t for t, s in self.timeout_s.items() if t not in self.tools or not 0 < s <= 3600]
        if bad:
            raise ValueError(f"timeout_s: {bad} must name tools of `tools` with 0 < seconds <= 3600")
        return self


def make_tools(o: ToolEnvOptions) -> dict[str, Tool]:
    made = {}
    for name in o.tools:
        if name == "python":
            made[name] = python_tool(o.timeout_s.get(name, 10.0), o.python_memory_mb, o.python_isolation)
        elif name == "calculator":
            made[name] = calculator_tool(o.timeout_s.get(name, 1.0))
    return made


class ToolShared:
    """What the episodes of one ``tools`` config share: the tools, the thread pool, the counters."""

    def __init__(self, options: ToolEnvOptions):
        self.options = options
        self.tools = make_tools(options)
        self.default_tool = options.default_tool or options.tools[0]
        self.pool = ThreadPoolExecutor(options.threads, thread_name_prefix="relay-tool")
        self.lock = threading.Lock()
        self.calls: Counter = Counter()  # tool -> calls
        self.failures: Counter = Counter()  # (tool, code) -> failed calls
        self.seconds: Counter = Counter()  # tool -> seconds spent

    def count(self, calls: list[ToolCall]) -> None:
        with self.lock:
            for c in calls:
                self.calls[c.name] += 1
                self.seconds[c.name] += c.seconds
                if not c.ok:
                    self.failures[(c.name, c.error.split(":", 1)[0])] += 1

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "tool_calls": dict(self.calls),
                "tool_seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "tool_failures": {f"{t}:{code}": n for (t, code), n in self.failures.items()},
            }

    def tool_specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self.tools.values()]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@register_env("tools")
class ToolEnv(Environment):
    Options = ToolEnvOptions
    Shared = ToolShared

    def __init__(self, options=None, shared: ToolShared | None = None):
        super().__init__(options)
        self.shared = shared if shared is not None else self.Shared(self.options)

    def reset(self, prompt) -> None:
        self.prompt = prompt

    def tool_specs(self) -> list[dict[str, Any]]:
        """The OpenAI ``tools`` list of this environment (for chat templates that render tools)."""
        return self.shared.tool_specs()

    def step(self, turn: str) -> StepResult:
        calls = parse_tool_calls(turn)
        if not calls:
            return StepResult(reply=None, done=True)
        outputs, records = self.run_calls(calls)
        return StepResult(reply="\n".join(outputs), done=False, role="tool", tool_calls=records)

    def run_calls(self, calls: list[ParsedCall]) -> tuple[list[str], list[ToolCall]]:
        """Run a turn's calls concurrently: their outputs (in order) and records (counted)."""
        sh = self.shared
        jobs: list = []  # per call: (output, record) when answered without running, else (future, tool, started)
        for i, call in enumerate(calls):
            name = call.name or sh.default_tool
            tool = sh.tools.get(name)
            label = name if tool is not None else "unknown"  # a made-up tool name is not a metrics label
            if call.error:
                jobs.append(
                    (f"error: {call.error}: could not read the tool call", ToolCall(label, False, 0.0, call.error))
                )
            elif i >= sh.options.max_calls_per_turn:
                jobs.append(
                    (
                        f"error: too_many_calls: at most {sh.options.max_calls_per_turn} calls a turn",
                        ToolCall(label, False, 0.0, "too_many_calls"),
                    )
                )
            elif tool is None:
                jobs.append(
                    (
                        f"error: unknown_tool: {name!r}; tools: {sorted(sh.tools)}",
                        ToolCall(label, False, 0.0, f"unknown_tool: {name[:40]}"),
                    )
                )
            else:
                jobs.append((sh.pool.submit(run_tool, tool, call.arguments), tool, time.monotonic()))
        outputs, records = [], []
        for job in jobs:
            if len(job) == 2:
                out, rec = job
            else:
                future, tool, started = job
                try:
                    out, rec = future.result(timeout=max(0.0, started + tool.timeout_s + GRACE_S - time.monotonic()))
                except FutureTimeout:
                    future.cancel()
                    out = f"error: timeout: no result within {tool.timeout_s}s"
                    rec = ToolCall(tool.name, False, time.monotonic() - started, "timeout")
            outputs.append(out)
            records.append(rec)
        sh.count(records)
        return outputs, records
