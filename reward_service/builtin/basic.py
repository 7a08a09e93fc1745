"""Small built-ins: exact match, per-position digits, a tagged final number, regex format checks,
DAPO length penalty."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from broker.runtime.config import StrictModel
from reward_service.plugins import Item, Result, RewardPlugin, register


@register("exact_match")
class ExactMatch(RewardPlugin):
    """1.0 when the stripped completion equals the stripped reference, else 0.0."""

    async def score(self, items: list[Item]) -> list[Result]:
        return [Result(float(it.completion.strip() == it.reference.strip())) for it in items]


@register("digits")
class DigitPositions(RewardPlugin):
    """Partial credit for the toy digit tasks: 0 when the completion did not end (no EOS), else
    (positions equal to the reference) / max(len(completion), len(reference))."""

    async def score(self, items: list[Item]) -> list[Result]:
        out = []
        for it in items:
            ans, ref = it.completion.strip(), it.reference.strip()
            if not ref:
                out.append(Result.failed("no_reference"))
                continue
            if not it.finished:
                out.append(Result(0.0, details={"finished": 0.0}))
                continue
            correct = sum(a == b for a, b in zip(ans, ref))
            score = correct / max(len(ans), len(ref))
            out.append(Result(score, details={"finished": 1.0, "exact": float(ans == ref)}))
        return out


class FinalNumberOptions(StrictModel):
    """The last tagged number of the completion against the reference number."""

    pattern: str = Field(
        r"answer\s*(?:is)?\s*[:=]?\s*\**\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)",
        description="Python regular expression with one group, the number; the LAST match in the "
        "completion is the answer (case-insensitive). The default takes 'Answer: 12', 'answer is "
        "12', '**Answer:** $1,200'",
    )
    correct_score: float = Field(1.0, description="score when the number equals the reference")
    format_score: float = Field(
        0.0,
        description="score when a tagged number is found but is wrong (a small "
        "reward for the format helps a model that does not yet tag its answers)",
    )
    miss_score: float = Field(0.0, description="score when no tagged number is found")
    require_finished: bool = Field(
        True,
        description="a completion cut at max_tokens gets at most miss_score "
        "for a wrong answer (no format credit for rambling)",
    )

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, v: str) -> str:
        try:
            rx = re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from None
        if rx.groups != 1:
            raise ValueError(f"the pattern must have exactly one group (the number); it has {rx.groups}")
        return v


def parse_number(text: str) -> float | None:
    """'1,200' -> 1200.0; None when the text is not a number."""
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


@register("final_number")
class FinalNumber(RewardPlugin):
    """``correct_score`` when the completion's last tagged number (``pattern``) equals the reference
    number, ``format_score`` when it is tagged but wrong, ``miss_score`` when none is tagged.
    A reference that is not a number fails the item (``unparsable_reference``: the dataset's fault)."""

    Options = FinalNumberOptions

    def __init__(self, options=None, observer=None):
        super().__init__(options, observer)
        self.rx = re.compile(self.options.pattern, re.IGNORECASE)

    async def score(self, items: list[Item]) -> list[Result]:
        o = self.options
        out = []
        for it in items:
            ref = parse_number(it.reference)
            if ref is None:
                out.append(Result.failed(f"unparsable_reference: not a number: {it.reference[:60]!r}"))
                continue
            found = self.rx.findall(it.completion)
            answer = parse_number(found[-1]) if found else None
            if answer is None:
                out.append(Result(o.miss_score, details={"tagged": 0.0}))
            elif answer == ref:
                out.append(Result(o.correct_score, details={"tagged": 1.0, "correct": 1.0}))
            else:
                wrong = o.format_score if (it.finished or not o.require_finished) else o.miss_score
                out.append(Result(wrong, details={"tagged": 1.0, "correct": 0.0}))
        return out


class RegexOptions(StrictModel):
    """A format check on the completion."""

    pattern: str = Field(description="Python regular expression")
    mode: Literal["search", "fullmatch"] = Field(
        "search", description="search: anywhere; fullmatch: the whole (stripped) completion"
    )
    ignore_case: bool = Field(False, description="re.IGNORECASE")
    dotall: bool = Field(True, description="re.DOTALL: '.' also matches newlines")
    multiline: bool = Field(False, description="re.MULTILINE")
    match_score: float = Field(1.0, description="score when the pattern matches")
    miss_score: float = Field(0.0, description="score when it does not")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from None
        return v


@register("regex")
class RegexFormat(RewardPlugin):
    """``match_score`` when ``pattern`` matches the completion, else ``miss_score``."""

    Options = RegexOptions

    def __init__(self, options=None, observer=None):
        super().__init__(options, observer)
        o = self.options
        flags = (
            (re.IGNORECASE if o.ignore_case else 0)
            | (re.DOTALL if o.dotall else 0)
            | (re.MULTILINE if o.multiline else 0)
        )
        self.rx = re.compile(o.pattern, flags)

    async def score(self, items: list[Item]) -> list[Result]:
        o = self.options
        out = []
        for it in items:
            hit = (
                self.rx.fullmatch(it.completion.strip()) if o.mode == "fullmatch" else self.rx.search(it.completion)
            ) is not None
            out.append(Result(o.match_score if hit else o.miss_score, details={"matched": float(hit)}))
        return out


class LengthOptions(StrictModel):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13)."""

    max_length: int = Field(ge=1, description="L_max: at or beyond this length the penalty is -1")
    cache: int = Field(
        ge=0,
        description="L_cache: the penalty ramps linearly from 0 to -1 over the last `cache` units before max_length",
    )
    unit: Literal["tokens", "chars"] = Field(
        "tokens", description="tokens (the item's num_tokens, sent by the generators) or characters of the completion"
    )

    @model_validator(mode="after")
    def _cache_fits(self) -> "LengthOptions":
        if self.cache > self.max_length:
            raise ValueError(f"cache ({self.cache}) must not exceed max_length ({self.max_length})")
        return self


def dapo_length_penalty(length: int, max_length: int, cache: int) -> float:
    """0 when length <= L_max - L_cache; ((L_max - L_cache) - length) / L_cache in the ramp; -1 beyond."""
    free = max_length - cache
    if length <= free:
        return 0.0
    if length <= max_length:
        return (free - length) / cache
    return -1.0


@register("length_penalty")
class LengthPenalty(RewardPlugin):
    """A score in [-1, 0]: combine it with a correctness plugin (weights in ``task_plugins``)."""

    Options = LengthOptions

    async def score(self, items: list[Item]) -> list[Result]:
        o = self.options
        out = []
        for it in items:
            if o.unit == "tokens":
                if it.num_tokens is None:
                    out.append(Result.failed("no_token_count: the caller sent no num_tokens (use unit = 'chars')"))
                    continue
                n = it.num_tokens
            else:
                n = len(it.completion)
            out.append(Result(dapo_length_penalty(n, o.max_length, o.cache), details={"length": float(n)}))
        return out
