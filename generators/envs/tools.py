"""Tools an environment runs for the model: plain functions with a name, JSON-schema parameters (as
in the OpenAI ``tools`` list) and a per-call timeout.

A tool's function takes the call's arguments and returns its output text, or raises
:class:`ToolFailure` with a short code (``bad_expression``, ``too_large``, ``sandbox_unavailable``,
...). :func:`run_tool` turns either into the text the model reads and a
:class:`~generators.envs.base.ToolCall` for the metrics (``error`` is ``"code: detail"``: the code
before the first colon is what is counted).

Built-ins:
  calculator  safe arithmetic (``+ - * / // % **``, parentheses, ints and floats) read with :mod:`ast`,
              never ``eval``: the tree is walked and only numbers and those operators are allowed,
              with bounds on the expression's length and the numbers' size.
  python      runs a program in the code sandbox of the reward service
              (:mod:`reward_service.builtin.sandbox`: namespaces, no network, no host files, time and
              memory limits) and returns what it printed. Where the sandbox cannot run (no root or
              CAP_SYS_ADMIN for namespaces, no cgroups), every call fails ``sandbox_unavailable``.
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable

from generators.envs.base import ToolCall
from generators.tool_calls import COMPACT_ARG

MAX_EXPRESSION = 200  # characters of a calculator expression
MAX_NODES = 100  # operators and numbers in it
MAX_INT_BITS = 4096  # size of any intermediate integer (2**4096 is ~1e1233)
MAX_OUTPUT = 4000  # characters of a tool's output the model reads


class ToolFailure(Exception):
    """The call failed; ``code`` is counted, the message is what the model reads."""

    def __init__(self, code: str, message: str = ""):
        super().__init__(f"{code}: {message}" if message else code)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Tool:
    """name, description and parameters (a JSON schema object) are what the model is told (the
    OpenAI ``tools`` entry); ``fn`` runs a call; ``timeout_s`` bounds one call."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[[dict[str, Any]], str]
    timeout_s: float = 5.0

    def spec(self) -> dict[str, Any]:
        """The OpenAI ``tools`` list entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def compact_arguments(self, content: str) -> dict[str, Any]:
        """A compact call's content as this tool's arguments (its single required parameter)."""
        required = self.parameters.get("required", [])
        if len(required) != 1:
            raise ToolFailure("bad_arguments", f"{self.name} takes no single argument: use the JSON form")
        return {required[0]: content}

    def check_arguments(self, args: dict[str, Any]) -> None:
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in args]
        unknown = [k for k in args if k not in props]
        if missing or unknown:
            raise ToolFailure(
                "bad_arguments", f"{self.name} needs {sorted(props)}; missing {missing}, unknown {unknown}"
            )
        for k, v in args.items():
            if props[k].get("type") == "string" and not isinstance(v, str):
                raise ToolFailure("bad_arguments", f"{k} must be a string")


def run_tool(tool: Tool, args: dict[str, Any]) -> tuple[str, ToolCall]:
    """Run one call: the output text for the model, and its record."""
    t0 = time.monotonic()
    try:
        if set(args) == {COMPACT_ARG} and COMPACT_ARG not in tool.parameters.get("properties", {}):
            args = tool.compact_arguments(args[COMPACT_ARG])
        tool.check_arguments(args)
        out = tool.fn(args)
    except ToolFailure as e:
        return f"error: {e}"[:MAX_OUTPUT], ToolCall(tool.name, False, time.monotonic() - t0, str(e)[:300])
    return out[:MAX_OUTPUT], ToolCall(tool.name, True, time.monotonic() - t0)


# ---- calculator -------------------------------------------------------------------------------

BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _check_size(v):
    if isinstance(v, int) and v.bit_length() > MAX_INT_BITS:
        raise ToolFailure("too_large", f"a number over {MAX_INT_BITS} bits")
    if isinstance(v, float) and not math.isfinite(v):
        raise ToolFailure("too_large", "the result is not finite")
    return v


def _power(a, b):
    """``a ** b``, refusing integer powers over MAX_INT_BITS before computing them."""
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 and b * a.bit_length() > MAX_INT_BITS:
        raise ToolFailure("too_large", f"a power over {MAX_INT_BITS} bits (exponent {b})")
    try:
        v = a**b
    except OverflowError:
        raise ToolFailure("too_large", "the result overflows") from None
    except ZeroDivisionError:
        _zero_division()
    if isinstance(v, complex):
        raise ToolFailure("bad_expression", "the result is not a real number")
    return v


def _zero_division():
    raise ToolFailure("division_by_zero", "division by zero")


def _eval(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(a, b))
        try:
            return _check_size(BINARY[type(node.op)](a, b))
        except ZeroDivisionError:
            _zero_division()
        except OverflowError:
            raise ToolFailure("too_large", "the result overflows") from None
    raise ToolFailure("bad_expression", f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression; ToolFailure (bad_expression, too_large,
    division_by_zero) otherwise."""
    if len(expression) > MAX_EXPRESSION:
        raise ToolFailure("bad_expression", f"longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ToolFailure(
            "bad_expression", f"cannot read {expression.strip()[:40]!r}: {getattr(e, 'msg', e)}"
        ) from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ToolFailure("bad_expression", f"more than {MAX_NODES} terms")
    return _eval(tree)


def format_number(v: int | float) -> str:
    """Ints as written; floats without a trailing ``.0`` when integral (``8/4`` -> ``2``)."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
        return str(int(v))
    return repr(v)


def calculator_tool(timeout_s: float = 1.0) -> Tool:
    return Tool(
        "calculator",
        "Evaluate an arithmetic expression: + - * / // % ** and parentheses on numbers.",
        {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 7*8"}},
            "required": ["expression"],
        },
        lambda args: format_number(calculate(args["expression"])),
        timeout_s,
    )


# ---- python (the code sandbox) ----------------------------------------------------------------


def python_tool(timeout_s: float = 10.0, memory_mb: int = 256, isolation: str = "cgroup") -> Tool:
    """Run Python in the reward service's sandbox. ``isolation`` as for ``code_exec``: "cgroup" (one
    cgroup per call; unavailable where cgroups cannot be made) or "rlimits" (per-process limits only)."""
    from reward_service.builtin import sandbox
    from reward_service.builtin.cgroups import CgroupError, Cgroups

    limits = sandbox.Limits(
        wall_s=timeout_s,
        cpu_s=max(1, math.ceil(timeout_s)),
        memory_mb=memory_mb,
        disk_mb=16,
        max_procs=16,
        max_output=MAX_OUTPUT,
    )
    cgroups: list[Cgroups] = []  # made on first use (a call that fails to make it says why)

    def run(args: dict[str, Any]) -> str:
        try:
            if isolation == "cgroup" and not cgroups:
                cgroups.append(Cgroups(None))
            o = asyncio.run(
                sandbox.run({"main.py": args["code"]}, ["main.py"], b"", limits, cgroups[0] if cgroups else None)
            )
        except (sandbox.SandboxError, CgroupError, OSError) as e:
            raise ToolFailure("sandbox_unavailable", str(e)[:200]) from None
        if o.timed_out:
            raise ToolFailure("timeout", f"the program ran over {timeout_s}s; output so far: {o.stdout[-500:]}")
        if o.returncode != 0:
            raise ToolFailure("exit_status", f"{o.returncode}; stderr: {o.stderr.strip()[-1000:]}")
        return o.stdout

    return Tool(
        "python",
        "Run a Python program (no network, no files of the host) and return what it printed.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
        },
        run,
        timeout_s,
    )


BUILTIN_TOOLS = {"calculator": calculator_tool, "python": python_tool}
