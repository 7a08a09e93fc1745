"""The code_exec grader: asserts split into what the sandbox evaluates and what stays with the grader;
the child's values compared as data, never through code the child provided."""

import json

import pytest

from reward_service.builtin import grader
from reward_service.builtin._code_runner import encode


def records(*recs):
    return "\n".join(json.dumps(r) for r in recs)


def test_the_expected_value_never_reaches_the_child():
    t = grader.parse_test("assert add(2, 2) == 918273645")
    assert t.steps == [{"eval": "add(2, 2)", "bool": False}]
    assert "918273645" not in json.dumps(t.steps)
    flipped = grader.parse_test("assert 'zebra-4471' == name(); assert (1, 2) > pair()")
    assert [s["eval"] for s in flipped.steps] == ["name()", "pair()"]
    assert [(c.op, c.expected) for c in flipped.checks] == [("==", "zebra-4471"), ("<", (1, 2))]
    assert "zebra" not in json.dumps(flipped.steps)
    negated = grader.parse_test("assert not is_prime(8)")
    assert negated.steps == [{"eval": "is_prime(8)", "bool": True}] and negated.checks[0].op == "falsy"


def test_set_up_statements_run_in_the_child_in_order():
    t = grader.parse_test("x = make()\nx.push(3)\nassert x.top() == 3\nx.pop()\nassert x.empty()")
    assert t.steps == [
        {"exec": "x = make()\nx.push(3)"},
        {"eval": "x.top()", "bool": False},
        {"exec": "x.pop()"},
        {"eval": "x.empty()", "bool": True},
    ]


@pytest.mark.parametrize(
    "src, why",
    [
        ("assert f(2) == g(3)", "not a literal"),
        ("x = 4\nassert f(2) == x", "not a literal"),
        ("for i in range(3):\n    assert f(i) == i", "inside a block"),
        ("f(2)", "no assert"),
        ("assert 0 < f(2) < 9", "chained"),
        ("assert f(2) is 4", "None, True or False"),
        ("assert f(", "does not parse"),
    ],
)
def test_tests_that_cannot_be_graded_outside_the_sandbox_are_refused(src, why):
    with pytest.raises(grader.BadTest, match=why):
        grader.parse_test(src)


def test_values_are_compared_as_python_compares_built_in_values():
    tests = [
        grader.parse_test(s)
        for s in [
            "assert f() == (1, 2)",
            "assert f() == [1, 2]",
            "assert f() == 1",
            "assert f() == {'a': {1, 2}}",
            "assert f() is None",
            "assert f() in (3, 4)",
            "assert f() == b'\\x00'",
        ]
    ]
    values = [(1, 2), [1, 2], 1.0, {"a": {2, 1}}, None, 4, b"\0"]
    out = records(*({"test": i, "step": 0, "value": encode(v)} for i, v in enumerate(values)), {"done": True})
    assert grader.grade(tests, out).passed == len(tests)
    swapped = [[1, 2], (1, 2), "1", {"a": [1, 2]}, False, 5, "\0"]  # what Python would not call equal either
    out = records(*({"test": i, "step": 0, "value": encode(v)} for i, v in enumerate(swapped)))
    v = grader.grade(tests, out)
    assert v.passed == 0 and not v.finished


def test_an_object_with_a_custom_eq_cannot_be_sent_so_it_fails():
    class Yes:
        def __eq__(self, other):
            return True

    (t,) = tests = [grader.parse_test("assert f() == 4")]
    assert encode(Yes()) == {"unsupported": "Yes"}
    assert grader.grade(tests, records({"test": 0, "step": 0, "value": encode(Yes())})).passed == 0
    # a forged record of any shape is data: no tag decodes to something that equals everything
    for forged in [{"unsupported": "int"}, {"eq": True}, {"int": 4, "x": 1}, {"dict": [[[1], 2]]}, "4", [4]]:
        assert grader.grade(tests, records({"test": 0, "step": 0, "value": forged})).passed == 0, forged


def test_a_test_passes_only_with_a_value_for_every_probe_and_no_error():
    tests = [grader.parse_test("assert f() == 1\nassert g() == 2"), grader.parse_test("assert f() == 1")]
    half = records({"test": 0, "step": 0, "value": 1}, {"test": 1, "step": 0, "value": 1})
    assert grader.grade(tests, half).passed == 1  # test 0's second probe never arrived
    errored = records({"test": 1, "error": "ZeroDivisionError"}, {"test": 1, "step": 0, "value": 1})
    assert grader.grade(tests, errored).passed == 0
    assert grader.grade(tests, 'garbage\n{"test": 7, "step": 0, "value": 1}\n[1]\n').passed == 0
