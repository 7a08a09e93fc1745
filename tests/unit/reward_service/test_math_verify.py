"""math_verify: answer equivalence through the math-verify library (in its worker process)."""

import asyncio

from reward_service.builtin.mathverify import verify_one
from reward_service.plugins import REGISTRY, Item

HALF = ["1/2", "0.5", r"\frac{1}{2}", r"$\frac{1}{2}$", r"The answer is \boxed{0.5}."]


async def _score(items):
    plug = REGISTRY["math_verify"]()
    try:
        return await plug.score(items)
    finally:
        await plug.close()


def test_one_half_in_every_notation_is_the_same_answer():
    items = [Item("", a, b) for a in HALF for b in HALF[:3]]
    wrong = [Item("", "1/3", "0.5"), Item("", "0.33", r"\frac{1}{3}"), Item("", "no answer here", "1/2")]
    out = asyncio.run(_score(items + wrong))
    assert [r.score for r in out[: len(items)]] == [1.0] * len(items), [
        (i.completion, i.reference, r) for i, r in zip(items, out) if r.score != 1.0
    ]
    assert [r.score for r in out[len(items) :]] == [0.0, 0.0, 0.0]
    assert out[-1].details == {"parsed": 0.0}  # no answer found: a real 0, and it says why


def test_an_unparsable_reference_fails_the_item_instead_of_scoring_zero():
    score, reason, _ = verify_one("1/2", "", 5, 6)
    assert score is None and reason.startswith("unparsable_reference")
