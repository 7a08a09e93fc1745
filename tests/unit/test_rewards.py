import asyncio

import pytest

from reward_service.plugins import REGISTRY, Item, RewardPlugin, register


def score(name, items):
    return asyncio.run(REGISTRY[name]().score(items))


def test_digits_gives_partial_credit_and_zero_without_eos():
    out = score("digits", [Item("473=", "473", "473"), Item("473=", "47", "473"), Item("473=", "4739", "473"),
                           Item("473=", "473", "473", finished=False)])
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
