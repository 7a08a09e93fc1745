"""The grader of ``code_exec``: it splits ``assert`` tests into what the sandbox evaluates and what it
compares, and it gives the verdict, in the reward service's process, which the program cannot reach.

A test is a snippet of top-level statements, at least one of them an ``assert``. Each assert is split
here (with :mod:`ast`) into

- a *probe*, the expression the sandboxed child evaluates in the solution's namespace
  (``f(2)`` of ``assert f(2) == 4``), and
- a *check*, the operator and the expected value that stay here (``== 4``).

The child sees the solution and the probes (plus the tests' other statements, e.g. set-up lines),
never an expected value; it writes each probe's value as tagged JSON data (:data:`RUNNER` encodes only
exact built-in types) and the grader decodes that data into built-in values and compares. The grader
never runs code the child provided: an object with a custom ``__eq__`` cannot be sent, only data, so
such an object fails every check. Whatever the child prints, exits with or writes instead of honest
results is a claim about values it had to compute: with the expected values out of its reach, the
only way to pass ``assert f(2) == 4`` is to send 4.

Supported asserts (anything else is ``bad_tests``, the dataset's fault, never a silent pass):

- ``assert PROBE OP LITERAL`` or ``assert LITERAL OP PROBE`` with one operator among
  ``== != < <= > >= in not in is is not`` (``is`` only with ``None``, ``True`` or ``False``), LITERAL
  being anything :func:`ast.literal_eval` reads (numbers, strings, bytes, tuples, lists, dicts, sets);
- ``assert PROBE`` and ``assert not PROBE``: the child sends ``bool(PROBE)`` and the grader knows
  whether True or False is expected.

A comparison whose expected side is not a literal (``assert f(2) == g(3)``, ``x = 4; assert f(2) ==
x``) is refused as ``bad_tests``: its expected value would have to be computed where the program runs.
An assert inside a block (a loop, a function) is refused too, and so is a test with no assert (a
test that only has to run without raising can be passed by any program). What the child sees is only
as secret as the test makes it: ``assert f(2) - 4 == 0`` shows it the 4, and an expected value that
is easy to guess (``assert is_prime(7)``: True or False) is easy to guess.
"""

from __future__ import annotations

import ast
import json
import operator
from dataclasses import dataclass, field
from pathlib import Path

RUNNER = Path(__file__).with_name("_code_runner.py").read_text()

OPS = {
    ast.Eq: ("==", operator.eq),
    ast.NotEq: ("!=", operator.ne),
    ast.Lt: ("<", operator.lt),
    ast.LtE: ("<=", operator.le),
    ast.Gt: (">", operator.gt),
    ast.GtE: (">=", operator.ge),
    ast.In: ("in", lambda a, b: a in b),
    ast.NotIn: ("not in", lambda a, b: a not in b),
    ast.Is: ("is", operator.is_),
    ast.IsNot: ("is not", operator.is_not),
}
BY_NAME = {name: fn for name, fn in OPS.values()}
FLIPPED = {ast.Eq: ast.Eq, ast.NotEq: ast.NotEq, ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE}
MAX_DEPTH = 64


class BadTest(ValueError):
    """A test the grader cannot grade outside the sandbox (the dataset's fault)."""


@dataclass(frozen=True)
class Check:
    op: str  # one of OPS' names, or "truthy" / "falsy"
    expected: object  # a literal (never sent to the sandbox)

    def passes(self, value: object) -> bool:
        if self.op == "truthy":
            return value is True
        if self.op == "falsy":
            return value is False
        try:
            return bool(BY_NAME[self.op](value, self.expected))
        except TypeError:  # an ordering between unrelated types, `in` on a non-container: Python raises too
            return False


@dataclass
class Test:
    steps: list[dict] = field(default_factory=list)  # what the child runs: {"exec": src} or {"eval": src, "bool": b}
    checks: list[Check] = field(default_factory=list)  # one per eval step, in order


def _literal(node: ast.expr) -> tuple[bool, object]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _split(test: ast.expr) -> tuple[ast.expr, bool, Check]:
    """(probe, send bool(probe)?, check) for one assert's condition."""
    if isinstance(test, ast.Compare):
        if len(test.ops) != 1:
            raise BadTest("a chained comparison: write one comparison per assert")
        op, left, right = type(test.ops[0]), test.left, test.comparators[0]
        right_lit, expected = _literal(right)
        if not right_lit:
            left_lit, expected = _literal(left)
            if not left_lit:
                raise BadTest(f"the expected side of {ast.unparse(test)[:80]!r} is not a literal")
            if op not in FLIPPED:
                raise BadTest(f"{ast.unparse(test)[:80]!r}: put the literal on the right of {OPS[op][0]!r}")
            op, left = FLIPPED[op], right
        if op in (ast.Is, ast.IsNot) and expected not in (None, True, False):
            raise BadTest("`is` compares only with None, True or False")
        return left, False, Check(OPS[op][0], expected)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return test.operand, True, Check("falsy", False)
    return test, True, Check("truthy", True)


def parse_test(src: str) -> Test:
    """Split one test snippet into the child's steps and the grader's checks; BadTest if it cannot be."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise BadTest(f"does not parse: {e}") from e
    top = {id(s) for s in tree.body}
    if any(isinstance(n, ast.Assert) and id(n) not in top for n in ast.walk(tree)):
        raise BadTest("an assert inside a block: only top-level asserts can be graded")
    if not any(isinstance(s, ast.Assert) for s in tree.body):
        raise BadTest("no assert: a test must assert something")
    out, pending = Test(), []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Assert):
            pending.append(stmt)
            continue
        if pending:
            out.steps.append({"exec": ast.unparse(ast.Module(body=pending, type_ignores=[]))})
            pending = []
        probe, as_bool, check = _split(stmt.test)
        out.steps.append({"eval": ast.unparse(probe), "bool": as_bool})
        out.checks.append(check)
    if pending:
        out.steps.append({"exec": ast.unparse(ast.Module(body=pending, type_ignores=[]))})
    return out


class Unsupported(ValueError):
    """A value the child could not (or did not) send as data: it fails every check."""


def decode(v: object, depth: int = 0) -> object:
    """The child's tagged JSON (see _code_runner.encode) -> built-in values, or Unsupported."""
    if depth > MAX_DEPTH:
        raise Unsupported("nested too deep")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [decode(x, depth + 1) for x in v]
    if not isinstance(v, dict) or len(v) != 1:
        raise Unsupported("malformed value")
    ((tag, body),) = v.items()
    try:
        if tag == "tuple":
            return tuple(decode(x, depth + 1) for x in body)
        if tag == "set":
            return {decode(x, depth + 1) for x in body}
        if tag == "frozenset":
            return frozenset(decode(x, depth + 1) for x in body)
        if tag == "dict":
            return {decode(k, depth + 1): decode(x, depth + 1) for k, x in body}
        if tag == "bytes":
            return bytes.fromhex(body)
        if tag == "complex":
            return complex(float(body[0]), float(body[1]))
    except (TypeError, ValueError) as e:  # an unhashable key or member, a malformed body
        raise Unsupported(f"malformed {tag}: {e}") from e
    if tag == "unsupported":
        raise Unsupported(f"a {str(body)[:60]} is not data")
    raise Unsupported(f"unknown tag {tag[:30]!r}")


@dataclass
class Verdict:
    passed: int
    total: int
    finished: bool  # the child said it reached the end (information only: it cannot make a test pass)
    errors: list[str]  # why tests failed, for details/logs


def grade(tests: list[Test], output: str) -> Verdict:
    """Compare the child's records (one JSON object a line) with the expected values held here.

    A test passes when the child sent a value for each of its probes and every value passes its
    check. The first record for a (test, step) counts; lines that are not records are ignored.
    """
    values: dict[tuple[int, int], object] = {}
    failed: dict[int, str] = {}
    finished = False
    for line in output.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("done") is True:
            finished = True
        t, s = rec.get("test"), rec.get("step")
        if type(t) is not int or not 0 <= t < len(tests):
            continue
        if "error" in rec:
            failed.setdefault(t, str(rec["error"])[:200])
        elif type(s) is int and "value" in rec:
            values.setdefault((t, s), rec["value"])
    passed = 0
    for t, test in enumerate(tests):
        if t in failed:
            continue
        probes = [i for i, st in enumerate(test.steps) if "eval" in st]
        ok = True
        for i, check in zip(probes, test.checks):
            if (t, i) not in values:
                ok = False
                failed[t] = "no value"
                break
            try:
                value = decode(values[(t, i)])
            except (Unsupported, RecursionError) as e:
                ok, failed[t] = False, str(e)
                break
            if not check.passes(value):
                ok, failed[t] = False, "assertion failed"
                break
        passed += ok
    return Verdict(passed, len(tests), finished, [f"test {t}: {why}" for t, why in sorted(failed.items())])
