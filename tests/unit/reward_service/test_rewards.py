import asyncio

import pytest

from reward_service.plugins import REGISTRY, Item, Result, RewardPlugin, register


def score(name, items):
    return asyncio.run(REGISTRY[name]().score(items))


def test_digits_gives_partial_credit_and_zero_without_eos():
    out = score(
        "digits",
        [
            Item("473=", "473", "473"),
            Item("473=", "47", "473"),
            Item("473=", "4739", "473"),
            Item("473=", "473", "473", finished=False),
        ],
    )
    assert [r.score for r in out] == [1.0, pytest.approx(2 / 3), 0.75, 0.0]
    assert out[0].details["exact"] == 1.0 and out[3].details["finished"] == 0.0


def test_missing_reference_is_a_failure_not_a_zero():
    (r,) = score("digits", [Item("1=", "1", "")])
    assert r.status == "failed" and r.score is None and r.reason == "no_reference"


def test_exact_match():
    assert [r.score for r in score("exact_match", [Item("", " a ", "a"), Item("", "b", "a")])] == [1.0, 0.0]


def test_registering_a_name_twice_is_an_error():
    @register("test_dummy")
    class Dummy(RewardPlugin):
        pass

    with pytest.raises(ValueError, match="already registered"):

        @register("test_dummy")
        class Other(RewardPlugin):
            pass

    del REGISTRY["test_dummy"]


# -- built-ins with options ------------------------------------------------------------------------

from pydantic import ValidationError  # noqa: E402

from reward_service.builtin.basic import dapo_length_penalty  # noqa: E402
from reward_service.config import RewardConfig  # noqa: E402
from reward_service.httpcall import CircuitBreaker  # noqa: E402
from reward_service.remote import parse_result  # noqa: E402
from reward_service.scoring import Scorer  # noqa: E402


def test_regex_format_check():
    plug = REGISTRY["regex"]({"pattern": r"<answer>\d+</answer>", "mode": "fullmatch", "miss_score": -1.0})
    out = asyncio.run(plug.score([Item("", "<answer>42</answer>"), Item("", "the <answer>42</answer>")]))
    assert [r.score for r in out] == [1.0, -1.0] and out[0].details == {"matched": 1.0}
    with pytest.raises(ValidationError, match="not a valid regular expression"):
        REGISTRY["regex"]({"pattern": "(unclosed"})


def test_final_number_takes_the_last_tagged_number_and_credits_the_format():
    plug = REGISTRY["final_number"]({"format_score": 0.2})
    out = asyncio.run(
        plug.score(
            [
                Item("", "3 + 4 = 7\nAnswer: 7", "7"),
                Item("", "Answer: 5. No wait, the answer is **1,200**.", "1200"),  # the last one counts, commas
                Item("", "Answer: 8", "7"),  # tagged but wrong
                Item("", "Answer: 8 and then", "7", finished=False),  # wrong and cut: no format credit
                Item("", "It is 7.", "7"),  # right number, no tag
                Item("", "Answer: 7", "seven"),  # the dataset's fault
            ]
        )
    )
    assert [r.score for r in out[:5]] == [1.0, 1.0, 0.2, 0.0, 0.0]
    assert out[2].details == {"tagged": 1.0, "correct": 0.0} and out[4].details == {"tagged": 0.0}
    assert out[5].status == "failed" and out[5].reason.startswith("unparsable_reference")
    with pytest.raises(ValidationError, match="exactly one group"):
        REGISTRY["final_number"]({"pattern": r"Answer: \d+"})


def test_dapo_overlong_penalty_is_the_papers_piecewise_ramp():
    # L_max = 20, L_cache = 4: free up to 16, linear to -1 at 20, -1 beyond
    assert [dapo_length_penalty(n, 20, 4) for n in (10, 16, 17, 18, 20, 21, 99)] == [
        0.0,
        0.0,
        -0.25,
        -0.5,
        -1.0,
        -1.0,
        -1.0,
    ]
    plug = REGISTRY["length_penalty"]({"max_length": 20, "cache": 4})
    ok, missing = asyncio.run(plug.score([Item("", "x", num_tokens=18), Item("", "x")]))
    assert ok.score == -0.5 and missing.status == "failed" and missing.reason.startswith("no_token_count")
    with pytest.raises(ValidationError, match="must not exceed max_length"):
        REGISTRY["length_penalty"]({"max_length": 4, "cache": 8})


def _scorer(**cfg) -> Scorer:
    return Scorer(RewardConfig(**cfg))


def test_weighted_route_sums_scores_and_fails_when_a_part_fails():
    s = _scorer(
        plugins={
            "fmt": {"type": "regex", "options": {"pattern": "^4"}},
            "len": {"type": "length_penalty", "options": {"max_length": 4, "cache": 2}},
        },
        task_plugins={"t": {"exact_match": 1.0, "fmt": 0.5, "len": 2.0}},
    )
    good, long_, no_tokens = asyncio.run(
        s.score(
            [
                Item("", "42", "42", task="t", num_tokens=2),
                Item("", "41", "42", task="t", num_tokens=3),
                Item("", "42", "42", task="t"),
            ]
        )
    )
    assert good.status == "ok" and good.score == 1.5 and good.plugin == "exact_match+fmt+len"
    assert good.details["exact_match"] == 1.0 and good.details["fmt.matched"] == 1.0
    assert long_.score == pytest.approx(0.0 + 0.5 + 2.0 * -0.5)
    assert no_tokens.status == "failed" and no_tokens.score is None and "(from len)" in no_tokens.reason


def test_route_by_a_metadata_field_then_by_task():
    s = _scorer(route_field="reward", task_plugins={"strict": "exact_match", "copy": "digits"})
    a, b = asyncio.run(
        s.score([Item("", "47", "43", task="copy", metadata={"reward": "strict"}), Item("", "47", "43", task="copy")])
    )
    assert (a.plugin, a.score) == ("exact_match", 0.0) and (b.plugin, b.score) == ("digits", 0.5)


def test_config_errors_name_the_field_and_what_is_valid():
    with pytest.raises(ValidationError, match="'nope' is neither a configured plugin"):
        RewardConfig(task_plugins={"t": "nope"})
    with pytest.raises(ValidationError, match="plugin type 'regex' needs options"):
        RewardConfig(task_plugins={"t": "regex"})
    with pytest.raises(ValidationError, match=r"(?s)plugins.r.options.*pattern: Field required"):
        RewardConfig(plugins={"r": {"type": "regex", "options": {"patern": "x"}}})
    with pytest.raises(ValidationError, match="is not a plugin type"):
        RewardConfig(plugins={"r": {"type": "regexp"}})


class Flaky(RewardPlugin):
    calls = 0

    async def score(self, items):
        Flaky.calls += len(items)
        return [
            Result(float(len(it.completion))) if it.completion != "boom" else Result.failed("boom: transient")
            for it in items
        ]


def test_cache_by_content_hash_keeps_ok_scores_and_retries_failures():
    register("test_flaky")(Flaky)
    try:
        s = _scorer(cache_size=10, task_plugins={"t": "test_flaky"})
        items = [Item("p", "abc", task="t"), Item("p", "boom", task="t")]
        first = asyncio.run(s.score(items))
        second = asyncio.run(s.score(items + [Item("p", "abc", task="t", metadata={"k": 1})]))
        assert [r.score for r in first] == [3.0, None] and [r.score for r in second] == [3.0, None, 3.0]
        # the ok score came from the cache; the failure and the different metadata were scored again
        assert Flaky.calls == 2 + 2
        text = __import__("prometheus_client").generate_latest(s.metrics.registry).decode()
        assert 'relay_reward_cache_total{plugin="test_flaky",result="hit"} 1.0' in text
        assert 'relay_reward_items_total{plugin="test_flaky",reason="boom",status="failed"} 2.0' in text
    finally:
        del REGISTRY["test_flaky"]


class Broken(RewardPlugin):
    async def score(self, items):
        return [Result(float("nan")), Result(1.0, status="weird"), "not a result"][: len(items)]


def test_a_plugins_bad_results_become_visible_failures():
    register("test_broken")(Broken)
    try:
        out = asyncio.run(_scorer(task_plugins={}).score([Item("", "a", task="test_broken")] * 3))
        assert [r.reason.split(":")[0] for r in out] == ["invalid_score", "plugin_error", "plugin_error"]
        assert all(r.score is None and r.status == "failed" for r in out)
        short = asyncio.run(_scorer(task_plugins={}).score([Item("", "a", task="test_broken")] * 4))
        assert all(r.reason.startswith("plugin_error: ValueError: plugin returned 3 results for 4") for r in short)
    finally:
        del REGISTRY["test_broken"]


class Huge(RewardPlugin):
    async def score(self, items):
        return [Result(3e38 if it.completion == "huge" else 9e5) for it in items]


def test_a_score_beyond_the_reward_bound_fails_the_item_with_the_reason():
    """Rewards are bounded (|r| <= 1e6, docs/protocol.md 3.2): a plugin's 3e38 fails its item, as does a
    weighted sum of scores that are each within the bound but add up beyond it."""
    register("test_huge")(Huge)
    try:
        s = _scorer(task_plugins={"sum": {"test_huge": 1.0, "digits": 1.0}, "twice": {"test_huge": 2.0}})
        out = asyncio.run(
            s.score(
                [
                    Item("", "huge", task="test_huge"),
                    Item("", "ok", task="test_huge"),
                    Item("", "ok", task="twice"),
                    Item("", "ok", task="sum", reference="1"),
                ]
            )
        )
        assert out[0].status == "failed" and out[0].reason == "invalid_score: 3e+38 is outside [-1e+06, 1e+06]"
        assert out[1].score == 9e5
        assert out[2].status == "failed" and "weighted sum 1.8e+06 is outside [-1e+06, 1e+06]" in out[2].reason
        assert out[3].status == "ok" and out[3].score == 9e5
    finally:
        del REGISTRY["test_huge"]


def test_remote_results_are_checked_item_by_item():
    assert parse_result({"score": 0.5, "details": {"a": 1}}, "r").score == 0.5
    assert parse_result({"score": 1}, "r").details == {}
    bad = [
        {"score": "0.5"},
        {"score": True},
        {"score": None},
        {"score": float("inf")},
        {"status": "maybe", "score": 1},
        {"score": 1, "details": {"a": "x"}},
        [1],
    ]
    assert all(parse_result(b, "r").reason.startswith("remote_malformed") for b in bad)
    failed = parse_result({"score": None, "status": "failed", "reason": "no answer"}, "r")
    assert failed.status == "failed" and failed.reason == "remote_failed: no answer"


def test_circuit_breaker_opens_after_consecutive_failures_and_half_opens():
    now = [0.0]
    states = []
    b = CircuitBreaker(failures=3, reset_s=10, clock=lambda: now[0], on_change=states.append)
    for _ in range(2):
        assert b.allow()
        b.record(False)
    b.record(True)  # a success resets the count
    for _ in range(3):
        assert b.allow()
        b.record(False)
    assert b.state == "open" and not b.allow()
    now[0] = 10.0
    assert b.allow() and b.state == "half_open"
    assert not b.allow()  # one trial at a time
    b.record(False)
    assert b.state == "open" and not b.allow()
    now[0] = 20.0
    assert b.allow()
    b.record(True)
    assert b.state == "closed" and b.allow()
    assert states == ["open", "half_open", "open", "half_open", "closed"]
