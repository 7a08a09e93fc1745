"""``calc``: a multi-turn tool task small enough for the built-in tiny model to learn on CPU.

A prompt is an expression and ``=`` (``7*8=``, task ``calc``), its reference the true result (``56``).
The calculator is the only tool and the default one, so the tiny model calls it in the compact form:

    turn 1  model: <tool_call>7*8</tool_call>      env (tool): 56
    turn 2  model: 56                              done, reward 1.0

(The Hermes JSON form ``<tool_call>{"name": "calculator", "arguments": {"expression": "7*8"}}</tool_call>``
is accepted too.) A turn without a tool call ends the episode; so does turn ``max_turns``.

Reward, computed here at ``done`` (the reward service is not asked), in [0, 1]:

    0                                  when no turn called a tool (the task requires the tool)
    0.1 * [turn 1 holds a readable calculator call]
  + 0.3 * expression match: the call's expression against the prompt's, position-wise
          (characters equal at the same position / the longer length; spaces ignored)
  + 0.6 * answer match, only when the call's expression was exactly the prompt's: the final answer
          (the last turn, when it calls no tool) against the TRUE result (the reference, which is then
          also what the tool returned), position-wise in the same way; 0 when the episode ran out of
          turns still calling tools

The answer counts only after an exact call so that the tool is the way to the full score: with
one-digit operands a model can memorise the products, and without the gate the tiny model learned
to call the tool with half an expression and answer from memory (0.5, flat; docs/agents.md).

A perfect episode scores 1.0. A random model rarely closes a tool call, so it starts near 0; one that
learned to call the tool with the right expression but answers wrongly gets 0.4 plus partial digits.
The parts are in ``StepResult.info`` (``tool``, ``expression``, ``answer``, ``turns``).
"""

from __future__ import annotations

from pydantic import Field

from broker.runtime.config import StrictModel
from generators.envs.base import EnvError, StepResult
from generators.envs.registry import register_env
from generators.envs.tool_env import ToolEnv, ToolEnvOptions, ToolShared
from generators.envs.toolcall import COMPACT_ARG, ParsedCall, parse_tool_calls
from generators.envs.tools import ToolFailure, calculate, format_number

W_TOOL, W_EXPRESSION, W_ANSWER = 0.1, 0.3, 0.6


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


def calc_reward(expression: str, truth: str, first_turn_calls: list[ParsedCall], called_tool: bool,
                answer: str | None) -> tuple[float, dict[str, float]]:
    """The episode's reward and its parts (see the module docstring)."""
    if not called_tool:
        return 0.0, {"tool": 0.0, "expression": 0.0, "answer": 0.0}
    expr = call_expression(first_turn_calls[0]) if first_turn_calls else None
    tool = 1.0 if expr is not None else 0.0
    expr_match = position_match("".join((expr or "").split()), "".join(expression.split())) if expr is not None else 0.0
    exact = expr_match == 1.0
    ans = position_match(answer.strip(), truth) if answer is not None and exact else 0.0
    reward = W_TOOL * tool + W_EXPRESSION * expr_match + W_ANSWER * ans
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
        self.truth = prompt.reference.strip()
        if not self.truth:
            try:
                self.truth = format_number(calculate(self.expression))
            except ToolFailure as e:
                raise EnvError("bad_prompt", f"calc prompt {prompt.text[:40]!r} has no reference and no value: {e}") from None
        self.turns = 0
        self.first_calls: list[ParsedCall] = []
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
        return StepResult(reply="\n".join(outputs), done=False, role="tool", tool_calls=records)

    def _end(self, answer: str | None) -> StepResult:
        reward, parts = calc_reward(self.expression, self.truth, self.first_calls, self.called_tool, answer)
        info = {**parts, "turns": self.turns}
        if answer is None:
            info["out_of_turns"] = 1
        return StepResult(reply=None, done=True, reward=reward, info=info)
