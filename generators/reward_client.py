"""The generator's client of the reward service: one ``POST /score`` per batch (the types are
broker/protocol/messages.py's ItemIn / ScoreRequest / ScoreResponse, the ones the service declares).

Failure behaviour: a failed call (an HTTP error, a timeout, an unreadable or short reply) is retried
with back-off (0.2 s doubling to 5 s). Refused connections mean nothing reached the service (down,
or being restarted), so for up to ``reward_down_s`` they are waited out without counting; after
that, and for every other failure, ``reward_retries`` retries are allowed. Then every item of the
batch is marked failed (``plugin`` "reward_service", the last error as the reason): a failure is
visible, never a silent 0. Used by the training loop (the sink) and by evaluation rounds.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import httpx

from broker.client.connection import Backoff
from broker.protocol.messages import ItemIn, PromptEntry, ResultOut, ScoreRequest, ScoreResponse
from generators.backends.base import Completion
from generators.config import GeneratorConfig

log = logging.getLogger("relay.generator.reward")


class RewardClient:
    def __init__(self, cfg: GeneratorConfig, stopped: Callable[[], bool] = lambda: False):
        self.retries, self.down_s, self.stopped = cfg.reward_retries, cfg.reward_down_s, stopped
        self.http = httpx.Client(base_url=cfg.reward_url, timeout=cfg.reward_timeout_s,
                                 headers={"Authorization": f"Bearer {cfg.reward_token}"} if cfg.reward_token else None)

    def score_groups(self, prompts: list[PromptEntry], groups: list[list[Completion]],
                     decode: Callable[[list[int]], str]) -> list[list[ResultOut]]:
        """One call for a whole batch: each prompt's completions -> their results, same shape."""
        items = [ItemIn(prompt=p.text, completion=decode(c.token_ids), reference=p.reference,
                        finished=c.finish_reason == "stop", task=p.task, num_tokens=len(c.token_ids),
                        metadata=p.metadata)
                 for p, cs in zip(prompts, groups) for c in cs]
        k = iter(self.score(items))
        return [[next(k) for _ in cs] for cs in groups]

    def score(self, items: list[ItemIn]) -> list[ResultOut]:
        """The results of ``items``, in order; all failed when the service could not score them."""
        backoff, failures, down_since = Backoff(0.2, 5.0), 0, None
        body = ScoreRequest(items=items).model_dump(mode="json")
        while True:
            try:
                resp = self.http.post("/score", json=body)
                resp.raise_for_status()
                results = ScoreResponse.model_validate_json(resp.content).results
                if len(results) != len(items):
                    raise ValueError(f"{len(results)} results for {len(items)} items")
                return results
            except (httpx.HTTPError, ValueError) as e:  # pydantic's ValidationError is a ValueError
                last_err = f"{type(e).__name__}: {e}"[:200]
                now = time.monotonic()
                # refused connections: nothing reached the service (down, or being restarted), so wait
                # for it up to reward_down_s before these count as failed attempts
                down_since = (down_since or now) if isinstance(e, httpx.ConnectError) else None
                if down_since is not None and now - down_since < self.down_s and not self.stopped():
                    log.warning("reward service unreachable for %.1fs, waiting for it: %s", now - down_since, last_err)
                else:
                    failures += 1
                    log.warning("reward call failed (attempt %d): %s", failures, last_err)
                    if failures > self.retries:
                        return [ResultOut.failed(f"reward_service: {last_err}", "reward_service") for _ in items]
                backoff.sleep()

    def close(self) -> None:
        self.http.close()

