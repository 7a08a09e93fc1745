"""The ``remote`` plugin: a reward server in any language, over HTTP (contract in docs/rewards.md).

Request  ``POST <url>``  ``{"items": [{"prompt", "completion", "reference", "finished", "task",
"metadata", "num_tokens"}, ...]}``
Reply    ``200``  ``{"results": [{"score": float | null, "status": "ok" | "failed", "reason": str,
"details": {str: float}}, ...]}``, one result per item, in order.

This is the same shape as the reward service's own ``POST /score``, so one Relay reward service
can be another one's remote. Large batches are split into requests of at most
``max_batch_items``, sent concurrently within ``max_concurrency``.

Failure reasons (the code before the colon is what the metrics count):
``remote_timeout``, ``remote_unreachable``, ``remote_http_<status>``, ``remote_malformed``
(not JSON, wrong number of results, a score that is not a finite number, ...),
``remote_circuit_open`` (the breaker is open: the server failed repeatedly and is left alone for
``breaker_reset_s``), ``remote_failed`` (the server itself said the item failed; its reason follows).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict

from pydantic import Field

from reward_service.httpcall import CallFailed, HttpCaller, HttpOptions
from reward_service.plugins import Item, Result, RewardPlugin, register


class RemoteOptions(HttpOptions):
    """A remote reward server."""

    url: str = Field(description="the server's scoring URL, e.g. http://127.0.0.1:9000/score", pattern=r"^https?://")
    max_batch_items: int = Field(256, ge=1, le=65536, description="items per request at most")


def parse_result(r, where: str) -> Result:
    """One result of a remote reply, checked; a malformed one is a failed item that says what is wrong."""
    if not isinstance(r, dict):
        return Result.failed(f"remote_malformed: {where} is not an object")
    status = r.get("status", "ok")
    if status == "failed":
        return Result.failed(f"remote_failed: {str(r.get('reason', ''))[:200]}")
    if status != "ok":
        return Result.failed(f"remote_malformed: {where} status {str(status)[:40]!r} is not 'ok' or 'failed'")
    score = r.get("score")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        return Result.failed(f"remote_malformed: {where} score {str(score)[:40]!r} is not a finite number")
    details = r.get("details", {})
    if not isinstance(details, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for k, v in details.items()
    ):
        return Result.failed(f"remote_malformed: {where} details must map names to finite numbers")
    return Result(float(score), details={k: float(v) for k, v in details.items()})


@register("remote")
class RemotePlugin(RewardPlugin):
    Options = RemoteOptions

    def __init__(self, options=None, observer=None):
        super().__init__(options, observer)
        self.http = HttpCaller(self.options.url, self.options, self.observer)

    async def close(self) -> None:
        await self.http.close()

    async def score(self, items: list[Item]) -> list[Result]:
        n = self.options.max_batch_items
        chunks = [items[i : i + n] for i in range(0, len(items), n)]
        parts = await asyncio.gather(*(self._score_chunk(c) for c in chunks))
        return [r for part in parts for r in part]

    async def _score_chunk(self, items: list[Item]) -> list[Result]:
        try:
            reply = await self.http.post_json({"items": [asdict(it) for it in items]})
        except CallFailed as e:
            return [Result.failed(f"remote_{e.code}: {e.detail}"[:300])] * len(items)
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list):
            return [Result.failed("remote_malformed: reply has no 'results' list")] * len(items)
        if len(results) != len(items):
            return [Result.failed(f"remote_malformed: {len(results)} results for {len(items)} items")] * len(items)
        return [parse_result(r, f"result {i}") for i, r in enumerate(results)]
