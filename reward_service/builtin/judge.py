"""``judge``: an LLM grades the completion through any OpenAI-compatible endpoint
(``POST {base_url}/chat/completions``: vLLM, SGLang, llama.cpp, TGI, a hosted API).

One request per item (chat completions take one conversation), ``max_concurrency`` in flight,
with the timeouts, retries, back-off and circuit breaker of every outbound call. The judge's reply
must contain the score (``score_regex``, first group); score = value / ``max_score``.

Failed: ``judge_timeout``, ``judge_unreachable``, ``judge_http_<status>``, ``judge_malformed``
(not an OpenAI chat-completions reply), ``judge_circuit_open``, ``judge_unparsable`` (no score in
the reply, or one outside [0, max_score]).
"""

from __future__ import annotations

import asyncio
import re

from pydantic import Field, field_validator

from reward_service.httpcall import CallFailed, HttpCaller, HttpOptions
from reward_service.plugins import Item, Result, RewardPlugin, register

DEFAULT_PROMPT = (
    "Grade the response to the question against the reference answer.\n\n"
    "Question:\n{prompt}\n\nReference answer:\n{reference}\n\nResponse:\n{completion}\n\n"
    "Reply with one line: `Score: N` where N is an integer from 0 (wrong) to 10 (fully correct)."
)


class JudgeOptions(HttpOptions):
    """An LLM judge."""

    base_url: str = Field(
        description="OpenAI-compatible API base, e.g. http://127.0.0.1:8000/v1", pattern=r"^https?://"
    )
    model: str = Field(description="model name sent in the request")
    system: str = Field("You are a strict, fair grader.", description="system message")
    prompt_template: str = Field(
        DEFAULT_PROMPT, description="user message; {prompt}, {completion}, {reference} are filled in"
    )
    score_regex: str = Field(
        r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)", description="finds the score in the reply (first group)"
    )
    max_score: float = Field(10.0, gt=0, description="the judge's scale; the reward is value / max_score")
    temperature: float = Field(0.0, ge=0, le=2, description="judge sampling temperature")
    max_tokens: int = Field(64, ge=1, le=32768, description="longest judge reply")
    timeout_s: float = Field(60.0, gt=0, le=3600, description="timeout of one attempt")

    @field_validator("score_regex")
    @classmethod
    def _one_group(cls, v: str) -> str:
        try:
            if re.compile(v).groups < 1:
                raise ValueError("needs one capturing group around the number")
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from None
        return v


@register("judge")
class Judge(RewardPlugin):
    Options = JudgeOptions

    def __init__(self, options=None, observer=None):
        super().__init__(options, observer)
        o = self.options
        self.http = HttpCaller(o.base_url.rstrip("/") + "/chat/completions", o, self.observer)
        self.rx = re.compile(o.score_regex)
        o.prompt_template.format(prompt="", completion="", reference="")  # fail at start on a bad template

    async def close(self) -> None:
        await self.http.close()

    async def score(self, items: list[Item]) -> list[Result]:
        return list(await asyncio.gather(*(self._one(it) for it in items)))

    async def _one(self, it: Item) -> Result:
        o = self.options
        body = {
            "model": o.model,
            "temperature": o.temperature,
            "max_tokens": o.max_tokens,
            "messages": [
                {"role": "system", "content": o.system},
                {
                    "role": "user",
                    "content": o.prompt_template.format(
                        prompt=it.prompt, completion=it.completion, reference=it.reference
                    ),
                },
            ],
        }
        try:
            reply = await self.http.post_json(body)
        except CallFailed as e:
            return Result.failed(f"judge_{e.code}: {e.detail}"[:300])
        try:
            text = reply["choices"][0]["message"]["content"]
            if not isinstance(text, str):
                raise TypeError("content is not a string")
        except (KeyError, IndexError, TypeError) as e:
            return Result.failed(f"judge_malformed: not a chat-completions reply ({type(e).__name__}: {e})"[:300])
        m = self.rx.search(text)
        if not m:
            return Result.failed(f"judge_unparsable: no score in {text[:80]!r}")
        value = float(m.group(1))
        if not 0 <= value <= o.max_score:
            return Result.failed(f"judge_unparsable: score {value} outside [0, {o.max_score}]")
        return Result(value / o.max_score, details={"judge_raw": value})
