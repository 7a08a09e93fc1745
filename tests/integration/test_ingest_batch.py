"""Batched ingest: one drain of many messages (duplicates, invalid ones, the queue bound reached in
the middle), the cached latest version, and GroupSender.send_many against a real broker."""

import msgpack
import pytest
import redis

from broker.client.announcements import announce
from broker.client.sender import GroupSender
from broker.client.telemetry import read_stats
from broker.protocol.keys import TRAJECTORIES_GROUP, Keys
from broker.protocol.group import encode_group
from broker.protocol.messages import Announcement
from broker.config import BrokerConfig
from broker.service import Broker
from tests.support.services import announce_key, announce_public_key_file, producer_keys, start_broker
from tests.support.data import announce_make_group_versions, make_group


def _group(gid: str, **kw) -> bytes:
    return encode_group(make_group(group_id=gid, **kw))  # its newest token version is 4


def _broker(redis_url: str, tmp_path, **extra) -> Broker:
    """A broker in this process whose ingest is driven directly (handle_batch; no socket, so no CURVE keys)."""
    return Broker(
        BrokerConfig(
            run_id="r",
            redis_url=redis_url,
            http_port=0,
            ingest_auth="insecure",
            announce_public_key_file=str(announce_public_key_file(tmp_path)),
            **extra,
        )
    )


def test_one_batch_gets_one_ack_per_message_in_order_and_exact_counters(redis_url, tmp_path):
    b = _broker(redis_url, tmp_path, max_queue_groups=3)
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    announce_make_group_versions(r, keys, announce_key(tmp_path))
    bad = msgpack.unpackb(_group("neg"), raw=False)
    bad["samples"][0]["logprobs"]["data"] = b"\x00\x00\x80\x3f" * 3  # +1.0: not a log-prob
    batch = [
        _group("a"),
        _group("a"),
        b"\x00garbage",
        _group("w", run_id="other"),
        _group("b"),
        msgpack.packb(bad),
        _group("b"),
        _group("c"),
        _group("d"),
        _group("a"),
    ]
    acks = b.ingest.handle_batch(batch)
    got = [(a.group_id, a.status, a.reason) for a in acks]
    assert got == [
        ("a", "ok", ""),
        ("a", "duplicate", ""),
        ("", "rejected", "not_msgpack"),
        ("w", "rejected", "wrong_run"),
        ("b", "ok", ""),
        ("neg", "rejected", "bad_logprob"),
        ("b", "duplicate", ""),
        ("c", "ok", ""),
        # the bound (3 unread) is reached inside the batch: busy, checked before duplicates
        ("d", "busy", ""),
        ("a", "busy", ""),
    ]
    assert len({a.stream_id for a in acks if a.status == "ok"}) == 3
    stats = read_stats(r, keys, "broker")
    assert stats["accepted"] == 3 and stats["duplicate"] == 2 and stats["busy"] == 2
    assert stats["rejected:not_msgpack"] == 1 and stats["rejected:wrong_run"] == 1
    assert stats["rejected:bad_logprob"] == 1 and stats["rejected_total"] == 3
    assert r.xlen(keys.dead_letter) == 3
    assert [f[b"gid"] for _, f in r.xrange(keys.trajectories)] == [b"a", b"b", b"c"]
    assert r.smembers(keys.seen) == {b"a", b"b", b"c"}  # busy groups were not marked seen

    # groups read by the learner (pending) no longer count against the bound
    r.xreadgroup(TRAJECTORIES_GROUP, "learner-0", {keys.trajectories: ">"}, count=2)
    assert [a.status for a in b.ingest.handle_batch([_group("d"), _group("e"), _group("f")])] == ["ok", "ok", "busy"]
    assert r.xlen(keys.trajectories) == 5


def test_cached_latest_version_never_rejects_a_newly_announced_version(redis_url, tmp_path):
    b = _broker(redis_url, tmp_path)
    key = announce_key(tmp_path)
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    ack = b.ingest.handle(_group("before"))  # nothing announced: its version's hash cannot match
    assert ack.status == "rejected" and ack.reason == "weight_hash"
    announce(r, keys, Announcement(version=3, hash="ab" * 32, path="/x"), key)
    announce(r, keys, Announcement(version=2, hash="ab" * 32, path="/x"), key)
    b.ingest._read_latest()  # the broker has cached version 2
    announce(r, keys, Announcement(version=4, hash="ab" * 32, path="/x"), key)
    # within the cache's lifetime, version 4 is ahead of the cached 2: a fresh read, not a rejection
    assert b.ingest.handle(_group("v4")).status == "ok"
    announce(r, keys, Announcement(version=3, hash="ab" * 32, path="/x"), key)
    b.ingest._read_latest()
    ack = b.ingest.handle(_group("v4-again"))
    assert ack.status == "rejected" and ack.reason == "version_ahead"
    assert read_stats(r, keys, "broker")["rejected:version_ahead"] == 1


def test_send_many_windows_groups_through_a_real_broker(procs, redis_url, tmp_path):
    address, _ = start_broker(procs, redis_url, tmp_path, max_queue_groups=1000)
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    announce_make_group_versions(r, keys, announce_key(tmp_path))
    sender = GroupSender(address, timeout_s=5, curve=producer_keys(tmp_path))
    items = [(f"g{i}", _group(f"g{i}")) for i in range(40)]
    acks = sender.send_many(items, window=16)
    assert sorted(acks) == sorted(g for g, _ in items) and {a.status for a in acks.values()} == {"ok"}
    assert len({a.stream_id for a in acks.values()}) == 40 and r.xlen(keys.trajectories) == 40
    again = sender.send_many(items[:10] + [("new", _group("new"))], window=4)  # resent: never appended twice
    assert {g: a.status for g, a in again.items()} == {**{g: "duplicate" for g, _ in items[:10]}, "new": "ok"}
    assert r.xlen(keys.trajectories) == 41 and sender.resends == 0
    with pytest.raises(ValueError):
        sender.send_many([("x", _group("x")), ("x", _group("x"))])


def test_send_many_meets_the_bound_exactly_and_backs_off(procs, redis_url, tmp_path):
    address, _ = start_broker(procs, redis_url, tmp_path, max_queue_groups=5)
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    announce_make_group_versions(r, keys, announce_key(tmp_path))
    sender = GroupSender(address, timeout_s=5, curve=producer_keys(tmp_path))
    items = [(f"g{i}", _group(f"g{i}")) for i in range(8)]
    with pytest.raises(TimeoutError):
        sender.send_many(items, window=8, give_up_s=1.0)
    assert sender.busy_waits > 0 and r.xlen(keys.trajectories) == 5  # no slack above max_queue_groups
    r.xtrim(keys.trajectories, maxlen=0)  # the learner consumed them all
    acks = sender.send_many(items, window=8)
    assert sorted(a.status for a in acks.values()) == ["duplicate"] * 5 + ["ok"] * 3
