"""The generator's client of the reward service: one ``POST /score`` per batch (the types are
broker/protocol/messages.py's ItemIn / ScoreRequest / ScoreResponse, the ones the service declares).

Failure behaviour (docs/rewards.md, "Failures"), by what the service answered:

- 401 or 403 (the service refused the generator's token) and 404 or 405 (no reward service at that
  URL): a configuration error, never retried: :class:`RewardRefused`, a ConfigError, which stops the
  generator with the reason (``relay generator`` exits 2; ``relay up`` then stops the run with it).
- no answer (refused connections, timeouts), 5xx, 408 or 429: the service is out. Retried with
  back-off (0.2 s doubling to 5 s); refused connections mean nothing reached the service (down, or
  being restarted), so for up to ``reward_down_s`` they are waited out without counting; after that,
  ``reward_retries`` retries are allowed. Then every item is marked failed with the reason code
  ``reward_service``, which the sink treats as an outage (it holds the batch: generators/sink.py).
- 200 with a body that is not a ScoreResponse (not JSON, another shape, the wrong number of results),
  or another 4xx (413, 422: the request was refused): the service answered, wrongly. Retried
  ``reward_retries`` times (a proxy's hiccup), then every item is marked failed with the code
  ``reward_malformed`` or ``reward_http_<status>``: not an outage, so the batch is sent as it is and
  its failures counted.

Every failed item names the plugin "reward_service" and the last error: a failure is visible, never a
silent 0. Used by the training loop (the sink) and by evaluation rounds.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import httpx

from broker.client.connection import Backoff, redact_url
from broker.runtime.config import ConfigError
from broker.protocol.messages import ItemIn, PromptEntry, ResultOut, ScoreRequest, ScoreResponse
from generators.backends.base import Completion
from generators.config import GeneratorConfig

log = logging.getLogger("relay.generator.reward")

# HTTP statuses that say the service is out (retried; the batch is held as an outage when they persist)
OUT_STATUSES = (408, 429)


class RewardRefused(ConfigError):
    """The reward service refused the generator (its token) or is not at ``reward_url``: no retry can
    fix it, so the generator stops with this message (exit 2)."""


def refusal(status: int, url: str, has_token: bool, body: str) -> RewardRefused:
    """The error for a 401/403/404/405 answer to ``POST {url}/score``, naming the setting to fix."""
    if status in (401, 403):
        sent = "" if has_token else ", and the generator sent none"
        return RewardRefused(
            f"the reward service at {url} refused the generator's token (HTTP {status}{sent}): set "
            f"generator.reward_token to its reward.auth_token (RELAY_REWARD_TOKEN, RELAY_AUTH_TOKEN; relay up "
            f"passes reward.auth_token on when generator.reward_token is unset)"
        )
    said = f" ({' '.join(body.split())[:80]})" if body.strip() else ""
    return RewardRefused(
        f"no reward service at {url}: POST /score answered HTTP {status}{said}; set "
        f"generator.reward.url to the reward service's base URL"
    )


class RewardClient:
    def __init__(self, cfg: GeneratorConfig, stopped: Callable[[], bool] = lambda: False):
        self.retries, self.down_s, self.stopped = cfg.reward.retries, cfg.reward.down_s, stopped
        self.env = cfg.episodes.env  # the generator's environment (multi-turn episodes), named in results
        self.url, self.has_token = redact_url(cfg.reward.url), bool(cfg.reward_token)
        self.http = httpx.Client(
            base_url=cfg.reward.url,
            timeout=cfg.reward.timeout_s,
            headers={"Authorization": f"Bearer {cfg.reward_token}"} if cfg.reward_token else None,
        )

    def score_groups(
        self, prompts: list[PromptEntry], groups: list[list[Completion]], decode: Callable[[list[int]], str]
    ) -> list[list[ResultOut]]:
        """One call for a whole batch: each prompt's completions -> their results, same shape.

        Multi-turn episodes (generators/episodes.py): an episode its environment scored keeps that
        score (plugin ``env:<name>``) and is not sent; one that failed (``episode["error"]``) is
        failed, never scored; the others are scored on their final answer (``answer_ids``, the last
        model turn), not the whole transcript. The episode's counts go into the result's details."""
        results: list[ResultOut | None] = []
        items: list[ItemIn] = []
        for p, cs in zip(prompts, groups):
            for c in cs:
                own = self._episode_result(c)
                results.append(own)
                if own is None:
                    ids = c.answer_ids if c.answer_ids is not None else c.token_ids
                    items.append(
                        ItemIn(
                            prompt=p.text,
                            completion=decode(ids),
                            reference=p.reference,
                            finished=c.finish_reason == "stop",
                            task=p.task,
                            num_tokens=len(ids),
                            metadata=p.metadata,
                        )
                    )
        scored = iter(self.score(items) if items else [])
        flat = iter([r if r is not None else next(scored) for r in results])
        out = [[next(flat) for _ in cs] for cs in groups]
        for cs, rs in zip(groups, out):
            for i, c in enumerate(cs):
                if c.episode is not None:
                    rs[i] = rs[i].model_copy(update={"details": {**rs[i].details, **episode_details(c.episode)}})
        return out

    def _episode_result(self, c: Completion) -> ResultOut | None:
        """The result an episode brings itself (failed, or its environment's score), or None: to score."""
        plugin = f"env:{self.env}"
        if c.episode is not None and c.episode.get("error"):
            return ResultOut.failed(f"env_error: {c.episode['error']}"[:300], plugin)
        if c.env_reward is not None:
            return ResultOut(score=float(c.env_reward), status="ok", plugin=plugin)
        return None

    def score(self, items: list[ItemIn]) -> list[ResultOut]:
        """The results of ``items``, in order; all failed when the service could not score them (the reason
        code ``reward_service`` for an outage, ``reward_malformed`` / ``reward_http_<status>`` for a wrong
        answer). Raises :class:`RewardRefused` when the service refuses the generator or is not there."""
        backoff, failures, down_since = Backoff(0.2, 5.0), 0, None
        body = ScoreRequest(items=items).model_dump(mode="json")
        while True:
            code = "reward_service"  # the reason code if this attempt is the last: an outage unless said below
            try:
                resp = self.http.post("/score", json=body)
                if resp.status_code in (401, 403, 404, 405):
                    raise refusal(resp.status_code, self.url, self.has_token, resp.text)
                if 400 <= resp.status_code < 500 and resp.status_code not in OUT_STATUSES:
                    code = f"reward_http_{resp.status_code}"  # the request was refused: not an outage
                resp.raise_for_status()
                code = "reward_malformed"  # it answered 200: whatever goes wrong below is its answer's fault
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
                        return [ResultOut.failed(f"{code}: {last_err}", "reward_service") for _ in items]
                backoff.sleep()

    def close(self) -> None:
        self.http.close()


def episode_details(episode: dict) -> dict[str, float]:
    """An episode's numbers kept with its reward details (which hold floats only)."""
    out = {
        "turns": float(episode.get("turns", 0)),
        "tool_calls": float(episode.get("tool_calls", 0)),
        "tool_failures": float(sum(episode.get("tool_failures_by_tool", {}).values())),
        "env_seconds": float(episode.get("env_seconds", 0.0)),
    }
    if episode.get("template_drift"):
        out["template_drift"] = 1.0
    return out
