"""A generator whose broker is gone stops promptly on SIGTERM, and the prompts it held stay
pending in Redis for another generator to reclaim (nothing is acknowledged that was not sent)."""

import signal
import time

import pytest
import redis
from transformers import AutoModelForCausalLM, AutoTokenizer

from broker.client.telemetry import read_heartbeats
from broker.protocol.keys import PROMPTS_GROUP, Keys
from deploy.launcher.procs import free_port
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.support.services import announce_key, generator_cfg, start_broker_and_reward, start_service, wait_http

pytestmark = pytest.mark.slow  # a run of several services: left to `make test` (docs/testing.md)


def test_sigterm_with_a_dead_broker_exits_and_keeps_prompts_pending(procs, redis_url, tmp_path):
    reward = free_port()
    rw = start_service(procs, "reward", "reward", {"port": reward}, tmp_path)
    wait_http(f"http://127.0.0.1:{reward}/healthz", rw)
    r, keys = redis.Redis.from_url(redis_url), Keys("stop")
    r.xgroup_create(keys.prompts, PROMPTS_GROUP, id="0", mkstream=True)
    for i in range(4):
        r.xadd(keys.prompts, {"text": "123=", "reference": "123", "task": "copy", "seq": i})
    path = build_tiny_model(tmp_path / "model")
    Publisher(
        r, keys, str(tmp_path / "weights"), AutoTokenizer.from_pretrained(path), 4, announce_key(tmp_path)
    ).publish(AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).state_dict(), 0)
    gen = start_service(
        procs,
        "gen",
        "generator",
        {
            "id": "g",
            "run_id": "stop",
            "redis_url": redis_url,
            "broker_address": f"tcp://127.0.0.1:{free_port()}",
            "reward_url": f"http://127.0.0.1:{reward}",
            "prompts_per_batch": 4,
        },
        tmp_path,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "resending group" not in gen.log_path.read_text():
        assert gen.alive(), gen.tail()
        time.sleep(0.2)
    assert "resending group" in gen.log_path.read_text(), gen.tail()  # it is retrying a dead broker
    assert r.xpending(keys.prompts, PROMPTS_GROUP)["pending"] == 4  # claimed, sampled, not delivered
    t0 = time.monotonic()
    gen.proc.send_signal(signal.SIGTERM)
    gen.proc.wait(30)
    assert time.monotonic() - t0 < 25, "the generator kept resending to a dead broker after SIGTERM"
    assert r.xpending(keys.prompts, PROMPTS_GROUP)["pending"] == 4  # still there to be reclaimed
    assert read_heartbeats(r, keys)["g"].state == "stopped"


def test_sigterm_drains_what_the_generator_holds(procs, redis_url, tmp_path):
    """With the broker up, SIGTERM stops claiming, delivers the batches already generated (or being
    generated), releases their prompts and exits 0: nothing claimed is left behind or lost."""
    # no evaluation round: a generator serving held-out prompts holds no training prompts to drain
    svc = start_broker_and_reward(procs, redis_url, tmp_path, "drain", prompt_backlog=64, eval={"every_versions": 0})
    r, keys = redis.Redis.from_url(redis_url), Keys("drain")
    path = build_tiny_model(tmp_path / "model")
    Publisher(
        r, keys, str(tmp_path / "weights"), AutoTokenizer.from_pretrained(path), 4, announce_key(tmp_path)
    ).publish(AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).state_dict(), 0)
    gen = start_service(
        procs,
        "gen",
        "generator",
        generator_cfg(svc, redis_url, "drain", "g", prompts_per_batch=8, sampling={"n": 16, "max_tokens": 32}),
        tmp_path,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and r.xlen(keys.trajectories) < 8:
        assert gen.alive(), gen.tail()
        time.sleep(0.1)
    assert r.xpending(keys.prompts, PROMPTS_GROUP)["pending"] > 0  # it holds prompts right now
    gen.proc.send_signal(signal.SIGTERM)
    assert gen.proc.wait(60) == 0, gen.tail()
    assert r.xpending(keys.prompts, PROMPTS_GROUP)["pending"] == 0  # every claimed prompt was delivered
    sent = read_heartbeats(r, keys)["g"].groups_sent
    assert sent == r.xlen(keys.trajectories) and sent % 8 == 0  # whole batches only, each group in Redis
    assert read_heartbeats(r, keys)["g"].state == "stopped"


def test_sigterm_abandons_a_batch_still_generating_after_the_grace(procs, redis_url, tmp_path):
    """A long batch (here 50 decode steps of 1 s each: a big model's, or the issue's 4096 tokens) does not hold
    a stop: 10 s after SIGTERM the batch still generating is abandoned and the generator exits, its prompts
    pending for another generator. (A Ctrl-C of relay up once waited 49 s for such a batch.)"""
    svc = start_broker_and_reward(procs, redis_url, tmp_path, "long", prompt_backlog=8, eval={"every_versions": 0})
    r, keys = redis.Redis.from_url(redis_url), Keys("long")
    path = build_tiny_model(tmp_path / "model")
    Publisher(
        r, keys, str(tmp_path / "weights"), AutoTokenizer.from_pretrained(path), 4, announce_key(tmp_path)
    ).publish(AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).state_dict(), 0)
    gen = start_service(
        procs,
        "gen",
        "generator",
        generator_cfg(
            svc,
            redis_url,
            "long",
            "g",
            prompts_per_batch=2,
            backend={"type": "torch", "step_latency_s": 1.0},
            sampling={"n": 4, "max_tokens": 50},
        ),
        tmp_path,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and r.xpending(keys.prompts, PROMPTS_GROUP)["pending"] == 0:
        assert gen.alive(), gen.tail()
        time.sleep(0.2)
    time.sleep(2)  # a few decode steps into the batch
    t0 = time.monotonic()
    gen.proc.send_signal(signal.SIGTERM)
    gen.proc.wait(60)
    assert time.monotonic() - t0 < 25, "the generator finished its 50 s batch before stopping"
    assert "the batch still generating 10s after the stop is abandoned" in gen.log_path.read_text(), gen.tail()
    assert r.xpending(keys.prompts, PROMPTS_GROUP)["pending"] == 2 and r.xlen(keys.trajectories) == 0
    assert read_heartbeats(r, keys)["g"].state == "stopped"
