"""The broker as a real process: real ZeroMQ sockets, a real Redis."""

import httpx
import msgpack
import redis

from broker.client.sender import GroupSender
from broker.client.telemetry import heartbeat, read_stats, register_service
from broker.protocol.keys import Keys
from broker.protocol.group import encode_group
from broker.protocol.messages import Heartbeat
from tests.support.services import announce_key, metric_value, producer_keys, start_broker, wait_until
from tests.support.data import announce_make_group_versions, make_group


def test_groups_are_appended_once_and_bad_ones_rejected_with_reason(procs, redis_url, tmp_path):
    address, _ = start_broker(procs, redis_url, tmp_path)
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    announce_make_group_versions(r, keys, announce_key(tmp_path))
    sender = GroupSender(address, timeout_s=5, curve=producer_keys(tmp_path))
    g = make_group(group_id="abc")
    ack = sender.send("abc", encode_group(g))
    assert ack.status == "ok" and ack.stream_id
    assert sender.send("abc", encode_group(g)).status == "duplicate"  # a resend is never appended twice
    assert r.xlen(keys.trajectories) == 1

    garbage = sender.send("", b"\x00not msgpack", give_up_s=10)
    assert garbage.status == "rejected" and garbage.reason == "not_msgpack"
    m = msgpack.unpackb(encode_group(make_group(group_id="neg")), raw=False)
    m["samples"][0]["logprobs"]["data"] = b"\x00\x00\x80\x3f" * 3  # +1.0: not a log-prob
    bad = sender.send("neg", msgpack.packb(m))
    assert bad.status == "rejected" and bad.reason == "bad_logprob"
    wrong_run = sender.send("w", encode_group(make_group(group_id="w", run_id="other")))
    assert wrong_run.reason == "wrong_run"

    stats = read_stats(r, keys, "broker")
    assert stats["accepted"] == 1 and stats["duplicate"] == 1
    assert stats["rejected:not_msgpack"] == 1 and stats["rejected:bad_logprob"] == 1
    assert r.xlen(keys.dead_letter) == 3
    assert r.xlen(keys.trajectories) == 1


def test_full_queue_answers_busy_until_the_learner_consumes(procs, redis_url, tmp_path):
    address, _ = start_broker(procs, redis_url, tmp_path, max_queue_groups=2)
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    announce_make_group_versions(r, keys, announce_key(tmp_path))
    sender = GroupSender(address, timeout_s=5, curve=producer_keys(tmp_path))
    for i in range(2):
        assert sender.send(f"g{i}", encode_group(make_group(group_id=f"g{i}"))).status == "ok"
    try:
        sender.send("g2", encode_group(make_group(group_id="g2")), give_up_s=1.0)
        raise AssertionError("a full queue must not accept more")
    except TimeoutError:
        pass
    assert sender.busy_waits > 0
    assert read_stats(r, keys, "broker")["busy"] >= 1
    oldest = r.xrange(keys.trajectories, count=1)[0][0]
    r.xdel(keys.trajectories, oldest)  # the learner consumed one
    assert sender.send("g2", encode_group(make_group(group_id="g2"))).status == "ok"


def test_prompts_are_fed_and_state_is_served(procs, redis_url, tmp_path):
    import httpx

    _, http = start_broker(procs, redis_url, tmp_path, prompt_backlog=5, task={"name": "reverse"})
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    # the feeder tops the stream up from the broker's loop, which may start just after /healthz answers
    wait_until(lambda: r.xlen(keys.prompts) >= 5, 10, "the feeder's first prompts")
    entries = r.xrange(keys.prompts)
    assert len(entries) == 5
    fields = entries[0][1]
    assert fields[b"task"] == b"reverse" and fields[b"text"].endswith(b"=")
    assert fields[b"reference"] == fields[b"text"][:-1][::-1]
    state = httpx.get(f"{http}/api/state").json()
    assert state["run_id"] == "r" and state["generators"] == [] and state["prompts_ready"] == 5
    metrics = httpx.get(f"{http}/metrics").text
    assert "relay_broker_prompts_fed_total" in metrics


def test_a_malformed_heartbeat_is_skipped_and_counted_and_the_page_keeps_working(procs, redis_url, tmp_path):
    _, http = start_broker(procs, redis_url, tmp_path)
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    heartbeat(r, keys, Heartbeat(id="gen-ok", version=None, state="sampling", backend="torch"))
    r.hset(keys.generators, "gen-bad", '{"version": "three"}')  # a producer in another language got it wrong
    r.hset(keys.generators, "gen-junk", "not json")
    st = httpx.get(f"{http}/api/state", timeout=10).json()
    assert [g["id"] for g in st["generators"]] == ["gen-ok"] and st["generators"][0]["state"] == "sampling"
    assert set(st["failures"]["malformed_heartbeats"]) == {"gen-bad", "gen-junk"}
    assert "version" in st["failures"]["malformed_heartbeats"]["gen-bad"]  # says what is wrong
    metrics = httpx.get(f"{http}/metrics", timeout=10)
    assert metrics.status_code == 200 and metric_value(metrics.text, "relay_broker_malformed_heartbeats") == 2
    assert httpx.get(f"{http}/", timeout=10).status_code == 200
    # Prometheus discovery: the live generator's /metrics is a target; an unreadable registration is skipped
    register_service(r, keys, "generator", "gen-ok", "127.0.0.1", 9999)
    r.hset(keys.services, "generator:gen-junk", "{}")
    targets = httpx.get(f"{http}/api/prometheus/targets", timeout=10).json()
    assert {"targets": ["127.0.0.1:9999"], "labels": {"service": "generator", "replica": "gen-ok"}} in targets
    assert len(targets) == 2  # the broker itself and gen-ok
