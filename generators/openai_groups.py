"""The OpenAI endpoint's sessions once they are rewarded (docs/openai-endpoint.md, "What is trained"): the
reward a caller posts (or asks the reward service for), and the wire group of a complete set of sessions,
sent to the broker through the generator's sink like any other group."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from broker.protocol.group import Group, Sample, versions_to_runs
from broker.protocol.messages import ItemIn
from generators.sessions import GroupParts, Session, SessionError

if TYPE_CHECKING:
    from generators.openai_endpoint import EndpointContext


def posted_reward(body: dict, reward_source: str) -> float | None:
    """The number a caller posted (None: it asks the reward service); refused with ``reward_source =
    "reward_service"``."""
    value = body.get("reward")
    if value is not None and reward_source == "reward_service":
        raise SessionError(
            403,
            "this endpoint takes rewards from the reward service only (openai.reward_source "
            '= "reward_service"): post {"task": <reward plugin>, "reference": <answer>}',
        )
    return value


def checked_reward(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise SessionError(
            400, 'the body must be {"reward": <finite number>} or {"task": <reward plugin>, "reference": <answer>}'
        )
    return float(value)


def score_session(s: Session | None, sid: str, task: str, reference: str, score) -> tuple[float, dict]:
    """The reward service's score (``score``: ``RewardClient.score``) of session ``sid``'s last answer (502
    when it could not score it)."""
    if s is None or not s.calls:
        raise SessionError(404, f"no session {sid!r} with an answer to score")
    held = s.held_messages
    prompt = next((m.get("content", "") for m in held if m.get("role") == "user"), held[0].get("text", ""))
    answer = held[-1].get("content", held[-1].get("text", ""))
    item = ItemIn(prompt=prompt, completion=answer, reference=reference, finished=s.finish_reason == "stop", task=task)
    r = score([item])[0]
    if not r.ok:
        raise SessionError(502, f"the reward service could not score session {sid!r}: {r.reason}")
    # a plugin's own "source" sub-score never hides where the reward came from
    return float(r.score), {**r.details, "source": f"reward_service:{r.plugin or task}"}


def _sample(s: Session, parts: GroupParts) -> Sample:
    ids, trainable, lps, versions = parts.completion(s)
    return Sample(
        completion_ids=np.asarray(ids, dtype=np.int32),
        logprobs=np.asarray(lps, dtype=np.float32),
        version_runs=versions_to_runs(versions),
        finish_reason=s.finish_reason,
        reward=s.reward,
        reward_status="ok",
        trainable=np.asarray(trainable, dtype=np.uint8),
        reward_details={**s.reward_details, "session": s.id, "calls": s.calls, "template_drift": s.template_drift},
    )


def session_group(parts: GroupParts, ctx: EndpointContext, max_tokens: int) -> Group:
    """The wire group of a complete set of sessions: labelled with the oldest version that sampled in it."""
    samples = [_sample(s, parts) for s in parts.sessions]
    first = min(parts.sessions, key=lambda s: s.weight_version)
    whash = first.weight_hash or (ctx.hash_for(first.weight_version) if ctx.hash_for is not None else "")
    now = time.time()
    return Group(
        group_id=Group.new_id(),
        run_id=ctx.run_id,
        prompt_id=f"openai:{parts.group}",
        prompt_ids=np.asarray(parts.prompt_ids, dtype=np.int32),
        samples=samples,
        generator_id=ctx.generator_id,
        weight_version=first.weight_version,
        weight_hash=whash,
        sampling={**ctx.sampling.model_dump(), "n": len(samples), "max_tokens": max_tokens},
        task="openai",
        created_at=min(s.created for s in parts.sessions) - time.monotonic() + now,
        scored_at=now,
        sent_at=now,
    )
