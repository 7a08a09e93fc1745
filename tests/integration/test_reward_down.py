"""A reward service that is down (say, being restarted by relay up's supervisor) is waited for: the
generator's scores arrive once it is back, instead of the batch being marked failed after
``reward_retries`` quick retries. Refused connections stop being waited for after ``reward_down_s``."""

import time

import pytest
import redis
from transformers import AutoModelForCausalLM, AutoTokenizer

from broker.client import queues
from broker.client.telemetry import read_heartbeats
from broker.protocol.keys import PROMPTS_GROUP, Keys
from deploy.launcher.procs import free_port
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.support.services import announce_key, start_service, wait_http, wait_until

pytestmark = pytest.mark.slow  # a run of several services: left to `make test` (docs/testing.md)


def _setup(procs, redis_url, tmp_path, run):
    ingest, http = free_port(), free_port()
    b = start_service(
        procs,
        "broker",
        "broker",
        {
            "run_id": run,
            "redis_url": redis_url,
            "http_port": http,
            "ingest_bind": f"tcp://127.0.0.1:{ingest}",
            "prompt_backlog": 8,
        },
        tmp_path,
    )
    wait_http(f"http://127.0.0.1:{http}/healthz", b)
    r, keys = redis.Redis.from_url(redis_url), Keys(run)
    path = build_tiny_model(tmp_path / "model")
    Publisher(
        r,
        keys,
        str(tmp_path / "weights"),
        AutoTokenizer.from_pretrained(path),
        keep_versions=4,
        announce_key=announce_key(tmp_path),
    ).publish(AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).state_dict(), 0)
    return ingest, r, keys


def _gen_cfg(run, redis_url, ingest, reward_port, **kw):
    return {
        "id": "g0",
        "run_id": run,
        "redis_url": redis_url,
        "broker_address": f"tcp://127.0.0.1:{ingest}",
        "reward_url": f"http://127.0.0.1:{reward_port}",
        "prompts_per_batch": 2,
        "sampling": {"n": 2, "max_tokens": 4},
        "reward_retries": 1,
        **kw,
    }


def test_generator_waits_for_a_reward_service_that_comes_back(procs, redis_url, tmp_path):
    ingest, r, keys = _setup(procs, redis_url, tmp_path, "down")
    reward = free_port()
    gen = start_service(procs, "gen", "generator", _gen_cfg("down", redis_url, ingest, reward), tmp_path)
    wait_until(
        lambda: "reward service unreachable" in gen.log_path.read_text(),
        120,
        f"the generator waiting for the reward service:\n{gen.tail()}",
    )
    wait_until(lambda: gen.log_path.read_text().count("reward service unreachable") >= 4, 30, "several retries")
    rw = start_service(procs, "reward", "reward", {"port": reward}, tmp_path)  # back, on the same port
    wait_http(f"http://127.0.0.1:{reward}/healthz", rw)
    entries = wait_until(
        lambda: queues.read_groups(r, keys, count=4) if r.xlen(keys.trajectories) >= 4 else None,
        60,
        f"groups:\n{gen.tail()}",
    )
    for _, g in entries:
        for s in g.samples:
            assert s.reward_status == "ok", s.reward_details  # scored, not marked failed
    assert "reward call failed" not in gen.log_path.read_text()


def test_a_reward_outage_holds_the_batch_claims_no_more_prompts_and_sends_it_scored(procs, redis_url, tmp_path):
    """Past reward_down_s the batch is not sent failed: the generator holds it (paused_reward, in its
    heartbeat), claims nothing more while the outage lasts (at most the batch it generated meanwhile), and
    once the service is back the held batch is scored and sent: nothing failed, no prompt burnt."""
    ingest, r, keys = _setup(procs, redis_url, tmp_path, "hold")
    reward = free_port()
    gen = start_service(
        procs, "gen", "generator", _gen_cfg("hold", redis_url, ingest, reward, reward_down_s=0.5), tmp_path
    )
    wait_until(
        lambda: (h := read_heartbeats(r, keys).get("g0")) is not None and h.state == "paused_reward",
        120,
        f"the generator paused for the reward outage:\n{gen.tail()}",
    )
    claimed = r.xpending(keys.prompts, PROMPTS_GROUP)["pending"]
    # the held batch, and at most two more: one waiting at the hand-over, one the engine generated meanwhile
    assert 2 <= claimed <= 6
    time.sleep(8)  # an outage of a while: nothing sent, nothing more claimed
    hb = read_heartbeats(r, keys)["g0"]
    assert r.xlen(keys.trajectories) == 0 and r.xpending(keys.prompts, PROMPTS_GROUP)["pending"] == claimed
    assert hb.state == "paused_reward" and hb.reward_pauses == 1 and hb.reward_failures == 0 and hb.groups_sent == 0
    rw = start_service(procs, "reward", "reward", {"port": reward}, tmp_path)  # back, on the same port
    wait_http(f"http://127.0.0.1:{reward}/healthz", rw)
    entries = wait_until(
        lambda: queues.read_groups(r, keys, count=4) if r.xlen(keys.trajectories) >= 4 else None,
        90,
        f"groups:\n{gen.tail()}",
    )
    for _, g in entries:
        for s in g.samples:
            assert s.reward_status == "ok", s.reward_details
    assert "reward outage over after" in gen.log_path.read_text()
    hb = wait_until(lambda: (h := read_heartbeats(r, keys)["g0"]).reward_paused_s > 0 and h, 30, "the pause counted")
    assert hb.reward_failures == 0 and hb.reward_paused_s >= 8


def test_a_reward_service_down_for_longer_than_reward_down_s_fails_the_batch_visibly(procs, redis_url, tmp_path):
    """With reward_outage_hold_s = 0 (no holding), the batch goes out failed, visibly."""
    ingest, r, keys = _setup(procs, redis_url, tmp_path, "gone")
    gen = start_service(
        procs,
        "gen",
        "generator",
        _gen_cfg("gone", redis_url, ingest, free_port(), reward_down_s=1.0, reward_outage_hold_s=0),
        tmp_path,
    )
    entries = wait_until(
        lambda: queues.read_groups(r, keys, count=2) if r.xlen(keys.trajectories) >= 2 else None,
        120,
        f"groups:\n{gen.tail()}",
    )
    for _, g in entries:
        for s in g.samples:
            assert s.reward_status == "failed" and s.reward_details["reason"].startswith("reward_service: ConnectError")
    log = gen.log_path.read_text()
    assert "reward service unreachable" in log and "reward call failed (attempt 2)" in log
