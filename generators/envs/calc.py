"""``calc``: a multi-turn tool task small enough for the built-in tiny model to learn on CPU.

A prompt is an expression and ``=`` (``7*8=``, task ``calc``), its reference the true result (``56``).
The calculator is the only tool and the default one, so the tiny model calls it in the compact form:

    turn 1  model: <tool_call>7*8</tool_call>      env (tool): 56
    turn 2  model: 56                              done, reward 1.0

(The Hermes JSON form ``<tool_call>{"name": "calculator", "arguments": {"expression": "7*8"}}</tool_call>``
is accepted too.) A turn without a tool call ends the episode; so does turn ``max_turns``.

Reward, computed here at ``done`` (the reward service is not asked), in [0, 1]:

    0                                  when no turn called a tool (the task requires the tool)
    0.1 * [turn 1's calculator call is one operation on two numbers (like ``7*3``) and returned a number]
  + 0.3 * e, e = expression match: turn 1's call's expression against the prompt's, position-wise
          (characters equal at the same position / the longer length; spaces ignored)
  + 0.6 * e * answer match: the final answer (the last turn, when it calls no tool) against WHAT THE
          TOOL RETURNED for turn 1's call, position-wise in the same way; 0 when the tool returned no
          number (an error) or the episode ran out of turns still calling tools

The answer is scored against the tool's result, never against the true result, so remembering the
product earns nothing: the way to the answer's credit is to read the tool. Weighting it by the
expression match makes the full score need the exact call (a call for ``7*3`` answered ``21`` earns
0.1 + 0.2 + 0.4 = 0.7, and only ``7*8`` answered ``56`` earns 1.0) while every step towards the exact
call is worth more once the model reads its results. (Earlier rewards were exploited: scored against
the true result, the tiny model called the tool with half the expression and answered from memory,
flat at 0.5; with the answer counted only after an exact call it settled on an empty call; docs/agents.md.)

A perfect episode scores 1.0. A random model rarely closes a tool call, so it starts near 0.
The parts are in ``StepResult.info`` (``tool``, ``expression``, ``answer``, ``turns``).
"""

from __future__ import annotations

import re

from pydantic import Field

from broker.runtime.config import StrictModel
from generators.envs.base import EnvError, StepResult
from generators.envs.registry import register_env
from generators.envs.tool_env import ToolEnv, ToolEnvOptions, ToolShared
from generators.envs.toolcall import COMPACT_ARG, ParsedCall, parse_tool_calls
from generators.envs.tools import ToolFailure, calculate

W_TOOL, W_EXPRESSION, W_ANSWER = 0.1, 0.3, 0.6
BINARY = re.compile(r"\s*\d+\s*[-+*/%]\s*\d+\s*")  # one operation on two whole numbers, like the prompts


class CalcOptions(StrictModel):
    """The calc task's environment."""

    max_turns: int = Field(3, ge=2, le=32, description="model turns per episode at most; the episode ends (and "
                           "is scored) at this turn whatever it says")
    timeout_s: float = Field(1.0, gt=0, le=60, description="seconds one calculator call may take")


def position_match(got: str, want: str) -> float:
    """Characters equal at the same position / the longer length (0 when both are empty)."""
    n = max(len(got), len(want))
    return sum(a == b for a, b in zip(got, want)) / n if n else 0.0


def call_expression(call: ParsedCall) -> str | None:
    """The expression a readable calculator call computes, else None."""
    if call.error:
        return None
    if call.compact:
        return call.arguments.get(COMPACT_ARG)
    expr = call.arguments.get("expression") if call.name == "calculator" else None
    return expr if isinstance(expr, str) else None


def calc_reward(expression: str, first_turn_calls: list[ParsedCall], called_tool: bool, answer: str | None,
                tool_result: str | None) -> tuple[float, dict[str, float]]:
    """The episode's reward and its parts (see the module docstring). ``tool_result``: what the tool
    returned for turn 1's call (None when it returned no number)."""
    if not called_tool:
        return 0.0, {"tool": 0.0, "expression": 0.0, "answer": 0.0}
    expr = call_expression(first_turn_calls[0]) if first_turn_calls else None
    tool = 1.0 if tool_result is not None and expr is not None and BINARY.fullmatch(expr) else 0.0
    expr_match = position_match("".join((expr or "").split()), "".join(expression.split())) if expr is not None else 0.0
    ans = position_match(answer.strip(), tool_result) if answer is not None and tool_result is not None else 0.0
    reward = W_TOOL * tool + W_EXPRESSION * expr_match + W_ANSWER * expr_match * ans
    return round(reward, 6), {"tool": tool, "expression": round(expr_match, 6), "answer": round(ans, 6)}


class CalcShared(ToolShared):
    def __init__(self, options: CalcOptions):
        super().__init__(ToolEnvOptions(tools=["calculator"], max_calls_per_turn=1,
                                        timeout_s={"calculator": options.timeout_s}, threads=4))


@register_env("calc")
class CalcEnv(ToolEnv):
    Options = CalcOptions
    Shared = CalcShared

    def reset(self, prompt) -> None:
        self.prompt = prompt
        self.expression = prompt.text.strip().removesuffix("=").strip()
        try:  # the answer is scored against the tool's result, so the prompt must be one the tool computes
            calculate(self.expression)
        except ToolFailure as e:
            raise EnvError("bad_prompt", f"calc prompt {prompt.text[:40]!r} is not an expression the calculator "
                           f"computes: {e}") from None
        self.turns = 0
        self.first_calls: list[ParsedCall] = []
        self.first_result: str | None = None  # what the tool returned for turn 1's call, when a number
        self.called_tool = False

    def step(self, turn: str) -> StepResult:
        self.turns += 1
        calls = parse_tool_calls(turn)
        if self.turns == 1:
            self.first_calls = calls
        if not calls:
            return self._end(answer=turn)
        self.called_tool = True
        if self.turns >= self.options.max_turns:
            return self._end(answer=None)
        outputs, records = self.run_calls(calls)
        if self.turns == 1 and records[0].ok:
            self.first_result = outputs[0].strip()
        return StepResult(reply="\n".join(outputs), done=False, role="tool", tool_calls=records)

    def _end(self, answer: str | None) -> StepResult:
        reward, parts = calc_reward(self.expression, self.first_calls, self.called_tool, answer, self.first_result)
        info = {**parts, "turns": self.turns}
        if answer is None:
            info["out_of_turns"] = 1
        return StepResult(reply=None, done=True, reward=reward, info=info)
