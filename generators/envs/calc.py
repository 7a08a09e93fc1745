"""``calc``: a multi-turn tool task small enough for the built-in tiny model to learn on CPU.

A prompt is an expression and ``=`` (``7*8=``, task ``calc``), its reference the true result (``56``).
The calculator is the only tool and the default one, so the tiny model calls it in the compact form:

    turn 1  model: <tool_call>7*8</tool_call>      env (tool): 56
    turn 2  model: 56                              done, reward 1.0

(The Hermes JSON form ``<tool_call>{"name": "calculator", "arguments": {"expression": "7*8"}}</tool_call>``
is accepted too.) A turn without a tool call ends the episode; so does turn ``max_turns``.

Reward, computed here at ``done`` (the reward service is not asked), in [0, 1]:

    0                      when no turn called a tool (the task requires the tool)
    0.05 * [turn 1 holds a readable calculator call]
  + 0.05 * [that call is one operation on two numbers (like ``7*3``) and the tool computed it]
  + 0.5 * e   e: the call's expression against the prompt's, position-wise (characters equal at the
              same position / the longer length; spaces ignored)
  + 0.4 * o² * a  o: the call's operands against the prompt's, digits position-wise, when the call has
              the prompt's operator (else 0); a: the final answer (the last turn, when it calls no
              tool) against WHAT THE TOOL RETURNED for turn 1's call, position-wise; 0 when the tool
              returned no number or the episode ran out of turns still calling tools

The answer is scored against the tool's result, never the true one, so remembering a product earns
nothing: the answer's credit comes from reading the tool. It is weighted by the operands' match, so a
call that ignores the prompt (the same ``4*4`` for every prompt, answered ``16`` from the tool) earns
no answer credit: 0.27, where ``7*3`` answered ``21`` earns 0.53 and only ``7*8`` answered ``56`` 1.0. It is
weighted by o squared so that ``7*0`` answered ``0`` (one operand right, an answer that needs no reading:
0.53) scores below the exact call answered wrongly (0.6): with o alone it scored 0.63, and a run settled on
``d*0`` answered ``0`` for every prompt (docs/agents.md).
Each rung (a readable call, a whole operation, the right characters, the tool's answer read back)
scores above the one before, so a random model finds the protocol. (What earlier rewards taught the
tiny model instead is in docs/agents.md: calling half an expression and answering from memory, an
empty call, a bare number, one fixed call for every prompt.)

A perfect episode scores 1.0. A random model rarely closes a tool call, so it starts near 0.
The parts are in ``StepResult.info`` (``tool``, ``expression``, ``operands``, ``answer``, ``turns``).
"""

from __future__ import annotations

import re

from pydantic import Field

from broker.runtime.config import StrictModel
from generators.envs.base import EnvError, StepResult
from generators.envs.registry import register_env
from generators.envs.tool_env import ToolEnv, ToolEnvOptions, ToolShared
from generators.tool_calls import COMPACT_ARG, ParsedCall, parse_tool_calls
from generators.envs.tools import ToolFailure, calculate

W_TOOL, W_EXPRESSION, W_ANSWER = 0.1, 0.5, 0.4
BINARY = re.compile(r"\s*(?P<a>\d+)\s*(?P<op>[-+*/%])\s*(?P<b>\d+)\s*")  # one operation on two whole numbers


class CalcOptions(StrictModel):
    """The calc task's environment."""

    max_turns: int = Field(
        3,
        ge=2,
        le=32,
        description="model turns per episode at most; the episode ends (and is scored) at this turn whatever it says",
    )
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


def operands_match(expr: str, expression: str) -> float:
    """The call's operands against the prompt's, digits position-wise, when the call is one operation
    with the prompt's operator (else 0): ``7*3`` against ``7*8`` is 1/2, ``7+8`` or ``78`` is 0."""
    call, want = BINARY.fullmatch(expr), BINARY.fullmatch(expression)
    if call is None or want is None or call["op"] != want["op"]:
        return 0.0
    return position_match(call["a"] + call["b"], want["a"] + want["b"])


def calc_reward(
    expression: str, first_turn_calls: list[ParsedCall], called_tool: bool, answer: str | None, tool_result: str | None
) -> tuple[float, dict[str, float]]:
    """The episode's reward and its parts (see the module docstring). ``tool_result``: what the tool
    returned for turn 1's call (None when it returned no number)."""
    if not called_tool:
        return 0.0, {"tool": 0.0, "expression": 0.0, "operands": 0.0, "answer": 0.0}
    expr = call_expression(first_turn_calls[0]) if first_turn_calls else None
    # half for a readable call, half for one operation on two numbers that the tool computed
    tool = 0.0 if expr is None else 0.5 + (0.5 if tool_result is not None and BINARY.fullmatch(expr) else 0.0)
    expr_match = position_match("".join(expr.split()), "".join(expression.split())) if expr is not None else 0.0
    operands = operands_match(expr, expression) if expr is not None else 0.0
    ans = position_match(answer.strip(), tool_result) if answer is not None and tool_result is not None else 0.0
    # o squared: a call with one operand right and a second that makes the answer trivial (7*0 answered 0, 7*1
    # answered 7) must score below the exact call answered wrongly, or it is where the policy settles
    reward = W_TOOL * tool + W_EXPRESSION * expr_match + W_ANSWER * operands**2 * ans
    return round(reward, 6), {
        "tool": tool,
        "expression": round(expr_match, 6),
        "operands": round(operands, 6),
        "answer": round(ans, 6),
    }


class CalcShared(ToolShared):
    def __init__(self, options: CalcOptions):
        super().__init__(
            ToolEnvOptions(
                tools=["calculator"], max_calls_per_turn=1, timeout_s={"calculator": options.timeout_s}, threads=4
            )
        )


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
            raise EnvError(
                "bad_prompt", f"calc prompt {prompt.text[:40]!r} is not an expression the calculator computes: {e}"
            ) from None
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
