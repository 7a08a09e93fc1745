"""A generator running episodes against a remote environment written in Node (tests/support/
remote_env_server.js, from docs/agents.md alone) as real processes: its episodes become multi-turn
groups; when the environment hangs or answers 500, the failures are counted by reason in the
generator's heartbeat (what the dashboard's Episodes panel shows), the failed episodes go out with a
failed reward (never an invented one), and the generator keeps running and recovers when the
environment does."""

import shutil
import time

import httpx
import pytest
import redis

from broker.client import queues
from broker.client.telemetry import read_heartbeats
from broker.protocol.keys import Keys
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from deploy.launcher.procs import free_port
from tests.support.services import (
    ROOT,
    announce_key,
    child_env,
    generator_cfg,
    start_broker_and_reward,
    start_service,
    wait_http,
    wait_until,
)

NODE = shutil.which("node")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        NODE is None,
        reason="node is not installed (`make nodejs` installs it as root): the remote environment of "
        "this test is written in Node",
    ),
]


def _samples(r, keys, after: bytes) -> tuple[list, bytes]:
    entries = queues.read_groups(r, keys, after)
    last = entries[-1][0] if entries else after
    return [s for _, g in entries for s in g.samples], last


def test_a_generator_runs_remote_episodes_and_survives_a_failing_environment(procs, redis_url, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    port = free_port()
    env_url = f"http://127.0.0.1:{port}"
    node = procs.start(
        "remote-env",
        [NODE, str(ROOT / "tests" / "support" / "remote_env_server.js"), "--port", str(port)],
        env=child_env(),
    )
    wait_http(f"{env_url}/stats", node)
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
    Publisher(
        r,
        keys,
        str(tmp_path / "weights"),
        AutoTokenizer.from_pretrained(path),
        keep_versions=10,
        announce_key=announce_key(tmp_path),
    ).publish(model, model.state_dict(), 0)
    gen = start_service(
        procs,
        "gen",
        "generator",
        generator_cfg(
            svc,
            redis_url,
            "t",
            "g0",
            prompts_per_batch=2,
            sampling={"n": 4, "max_tokens": 8},
            env="remote",
            env_options={"url": env_url, "timeout_s": 0.5, "retries": 1, "breaker_reset_s": 2.0},
            max_turns=3,
            max_episode_tokens=48,
        ),
        tmp_path,
    )

    def episodes():
        hb = read_heartbeats(r, keys).get("g0")
        return hb.episodes if hb is not None else {}

    # healthy: episodes run through the Node server, scored by it
    wait_until(lambda: episodes().get("episodes", 0) >= 16, timeout=120, what=f"episodes\n{gen.tail()}")
    samples, last = _samples(r, keys, b"-")
    assert samples and all(s.reward_status == "ok" for s in samples if s.finish_reason == "stop")
    assert httpx.get(f"{env_url}/stats").json()["steps"] > 0

    # the environment answers 500: failures counted by reason, samples failed, the generator alive
    httpx.post(f"{env_url}/control", json={"mode": "500"}).raise_for_status()
    wait_until(
        lambda: sum(episodes().get("env_failures", {}).values()) >= 8,
        timeout=120,
        what=f"environment failures counted\n{gen.tail()}",
    )
    failures = episodes()["env_failures"]
    assert any(k.startswith("http_500") or k == "circuit_open" for k in failures), failures
    wait_until(
        lambda: any(s.reward_status == "failed" for s in _samples(r, keys, last)[0]),
        timeout=60,
        what="a failed episode sent with a failed reward",
    )
    assert gen.alive()

    # healthy again: episodes succeed again (after the circuit breaker's reset time)
    httpx.post(f"{env_url}/control", json={"mode": "ok"}).raise_for_status()
    _, last = _samples(r, keys, last)
    time.sleep(0.5)
    wait_until(
        lambda: any(s.reward_status == "ok" and s.finish_reason == "stop" for s in _samples(r, keys, last)[0]),
        timeout=120,
        what=f"episodes succeeding again\n{gen.tail()}",
    )
    assert gen.alive()
