"""A generator running ``calc`` episodes as a real process against real Redis, broker and reward
service: its groups carry multi-turn samples (the tool's reply as context tokens, trainable 0), the
environment's reward (plugin ``env:calc``, the reward service not asked), behaviour log-probs equal to
the learner's recomputation at every model token, and its heartbeat reports the episodes."""

import pytest
import redis
import torch

from broker.client import queues
from broker.client.telemetry import read_heartbeats
from broker.protocol.keys import Keys
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.support.models import recompute_logprobs
from tests.support.services import announce_key, generator_cfg, start_broker_and_reward, start_service, wait_until

pytestmark = pytest.mark.slow  # a run of several services: left to `make test` (docs/testing.md)


def test_generator_sends_calc_episodes_with_their_mask_and_the_environments_reward(procs, redis_url, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    svc = start_broker_and_reward(
        procs,
        redis_url,
        tmp_path,
        "t",
        prompt_backlog=8,
        max_queue_groups=100_000,
        task={"name": "calc", "min_digits": 1, "max_digits": 1},
    )
    r, keys = redis.Redis.from_url(redis_url), Keys("t")
    path = build_tiny_model(tmp_path / "model", tools=True)
    model = AutoModelForCausalLM.from_pretrained(path)
    pub = Publisher(
        r,
        keys,
        str(tmp_path / "weights"),
        AutoTokenizer.from_pretrained(path),
        keep_versions=10,
        announce_key=announce_key(tmp_path),
    )
    pub.publish(model, model.state_dict(), 0)
    sampling = {"n": 8, "max_tokens": 8}
    gen = start_service(
        procs,
        "gen",
        "generator",
        generator_cfg(
            svc,
            redis_url,
            "t",
            "g0",
            prompts_per_batch=4,
            sampling=sampling,
            env="calc",
            max_turns=3,
            max_episode_tokens=48,
        ),
        tmp_path,
    )
    entries = wait_until(
        lambda: queues.read_groups(r, keys, count=8) if r.xlen(keys.trajectories) >= 8 else None,
        timeout=90,
        what=f"groups from the generator:\n{gen.tail()}",
    )
    tool_reply = budget_cut = 0
    for _, g in entries:
        assert g.task == "calc" and len(g.samples) == 8
        for s in g.samples:
            if s.finish_reason == "stop":  # the environment ended and scored it
                assert s.reward_status == "ok" and 0.0 <= s.reward <= 1.0 and s.reward_details["turns"] >= 1
            else:  # cut by the episode's budget: the reward service scores the last turn (no calc route here)
                budget_cut += 1
            recomputed = recompute_logprobs(model, g.prompt_ids.tolist(), s.completion_ids.tolist())
            mask = (
                torch.ones(len(s.completion_ids), dtype=torch.bool)
                if s.trainable is None
                else torch.from_numpy(s.trainable.astype(bool))
            )
            got = torch.from_numpy(s.logprobs.copy())
            assert torch.allclose(recomputed[mask], got[mask], atol=1e-4)
            if s.trainable is not None and not s.trainable.all():
                tool_reply += 1
                ctx = s.completion_ids[~s.trainable.astype(bool)].tolist()
                assert ctx[0] == 18 and ctx[-1] == 19  # <tool_response> ... </tool_response>, never trained
                assert (got[~mask] == 0).all()
    # the 8 groups' 64 episodes reach the heartbeat within a heartbeat or two of the groups being sent
    hb = wait_until(
        lambda: (h := read_heartbeats(r, keys).get("g0")) and h.episodes.get("episodes", 0) >= 64 and h,
        timeout=20,
        what=f"a heartbeat counting 64 episodes (last: {read_heartbeats(r, keys).get('g0')})",
    )
    ep = hb.episodes
    assert ep["episodes"] >= 64 and ep["turns"] >= ep["episodes"] and ep["template_drift"] == 0
    assert ep["env_failures"] == {}
    # a random model rarely writes a well-formed tool call; when one did, its reply came back as context
    assert tool_reply == 0 or sum(ep["tool_calls"].values()) > 0
