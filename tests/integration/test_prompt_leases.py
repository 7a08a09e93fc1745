"""A generator keeps the prompts it works on: it renews its claims while it holds them, so that a batch
taking longer than ``claim_idle_s`` is not reclaimed by another generator and generated twice
(docs/protocol.md 7.2, generators/leases.py); a stopped generator's prompts are still taken over."""

import collections
import time

import pytest
import redis

from broker.client import queues
from broker.protocol.keys import PROMPTS_GROUP, Keys
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.support.services import announce_key, generator_cfg, start_broker_and_reward, start_service, wait_until


def _owner_and_idle(r, stream, eid):
    p = r.xpending_range(stream, PROMPTS_GROUP, eid, eid, 1)
    return (p[0]["consumer"], p[0]["time_since_delivered"]) if p else (None, None)


def test_renewal_resets_only_the_entries_still_held_by_that_consumer(redis_url):
    r, stream = redis.Redis.from_url(redis_url), "relay:lease:prompts"
    r.xgroup_create(stream, PROMPTS_GROUP, id="0", mkstream=True)
    e1, e2, e3 = (r.xadd(stream, {"n": str(i)}) for i in range(3))
    r.xreadgroup(PROMPTS_GROUP, "a", {stream: ">"}, count=2)  # a holds e1, e2
    r.xreadgroup(PROMPTS_GROUP, "b", {stream: ">"}, count=1)  # b holds e3
    time.sleep(0.3)

    assert queues.renew_claims(r, stream, "a", [e1, e2, e3]) == {e1, e2}
    assert _owner_and_idle(r, stream, e1)[0] == b"a" and _owner_and_idle(r, stream, e1)[1] < 200
    owner, idle = _owner_and_idle(r, stream, e3)
    assert owner == b"b" and idle >= 300  # b's entry neither stolen nor renewed

    # b takes e2 over (as claim_abandoned does with a stopped consumer's entry): a's renewal leaves it to b
    r.xautoclaim(stream, PROMPTS_GROUP, "b", 0, start_id=e2, count=1)
    assert queues.renew_claims(r, stream, "a", [e1, e2]) == {e1}
    assert _owner_and_idle(r, stream, e2)[0] == b"b"

    # a released entry is not brought back
    r.xack(stream, PROMPTS_GROUP, e1)
    r.xdel(stream, e1)
    assert queues.renew_claims(r, stream, "a", [e1]) == set()
    assert _owner_and_idle(r, stream, e1) == (None, None)


@pytest.mark.slow  # a run of several services: left to `make test` (docs/testing.md)
def test_batches_longer_than_the_claim_timeout_are_generated_once(procs, redis_url, tmp_path):
    """Two generators whose batches take ~3x ``claim_idle_s``: without renewal each claim() took the other's
    (and its own sink's) prompts over mid-batch, and most prompts came back as two groups."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    svc = start_broker_and_reward(procs, redis_url, tmp_path, "t", prompt_backlog=8, max_queue_groups=100_000)
    r, keys = redis.Redis.from_url(redis_url), Keys("t")
    path = build_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path)
    Publisher(
        r,
        keys,
        str(tmp_path / "weights"),
        AutoTokenizer.from_pretrained(path),
        keep_versions=10,
        announce_key=announce_key(tmp_path),
    ).publish(model, model.state_dict(), 0)
    # 6 decode steps of 0.5 s: a batch holds its prompts ~3 s, three times claim_idle_s
    for i in range(2):
        start_service(
            procs,
            f"gen-{i}",
            "generator",
            generator_cfg(
                svc,
                redis_url,
                "t",
                f"g{i}",
                prompts_per_batch=2,
                claim_idle_s=1.0,
                sampling={"n": 2, "max_tokens": 6},
                backend={"type": "torch", "step_latency_s": 0.5},
            ),
            tmp_path,
        )
    wait_until(lambda: r.xlen(keys.trajectories) >= 12, 120, "12 groups from the two generators")

    groups = [g for _, g in queues.read_groups(r, keys)]
    per_prompt = collections.Counter(g.prompt_id for g in groups)
    assert max(per_prompt.values()) == 1, {p: n for p, n in per_prompt.items() if n > 1}
    assert {g.generator_id for g in groups} == {"g0", "g1"}
