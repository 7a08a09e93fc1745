"""The calculator tool (generators/envs/tools.py); the tool-call parser's tests: test_tool_calls.py."""

import time

import pytest

from generators.tool_calls import parse_tool_calls
from generators.envs.tools import ToolFailure, calculate, calculator_tool, run_tool


@pytest.mark.parametrize(
    "expr,value",
    [
        ("7*8", 56),
        ("(1+2)*3", 9),
        ("7/2", 3.5),
        ("7//2", 3),
        ("-7%3", 2),
        ("2**10", 1024),
        ("1.5*2", 3.0),
        ("2**-1", 0.5),
        (" 12 - 30 ", -18),
    ],
)
def test_calculator_good(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize(
    "expr,code",
    [
        ("__import__('os')", "bad_expression"),
        ("x+1", "bad_expression"),
        ("7*", "bad_expression"),
        ("1/0", "division_by_zero"),
        ("'a'*3", "bad_expression"),
        ("True+1", "bad_expression"),
        ("9**9**9", "too_large"),
        ("2**100000", "too_large"),
        ("10.0**400", "too_large"),
        ("(-8)**0.5", "bad_expression"),
        ("1+" * 150 + "1", "bad_expression"),
    ],
)
def test_calculator_refuses_with_a_code(expr, code):
    with pytest.raises(ToolFailure) as e:
        calculate(expr)
    assert e.value.code == code


def test_huge_exponent_is_refused_fast_and_reported_to_the_model():
    t0 = time.monotonic()
    out, rec = run_tool(calculator_tool(), {"expression": "99999**99999999"})
    assert time.monotonic() - t0 < 0.5
    assert rec.ok is False and rec.error.startswith("too_large") and out.startswith("error: too_large")


def test_calculator_bad_arguments():
    out, rec = run_tool(calculator_tool(), {"expr": "1+1"})
    assert not rec.ok and rec.error.startswith("bad_arguments") and "expression" in out


def test_a_compact_call_runs_the_default_tool():
    [c] = parse_tool_calls("<tool_call>7*8</tool_call>")
    out, rec = run_tool(calculator_tool(), c.arguments)
    assert (out, rec.ok, rec.name) == ("56", True, "calculator")
