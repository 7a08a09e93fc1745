"""Records that would grow with a run's length are capped by configuration: the announcements kept
(learner.publish.keep_announcements) and the events stream (broker.events_kept). Real Redis, the broker's ingest
driven in-process."""

import redis

from broker.client.announcements import announce
from broker.client.telemetry import emit_event
from broker.config import BrokerConfig
from broker.protocol.group import encode_group
from broker.protocol.keys import Keys
from broker.protocol.messages import Announcement
from broker.service import Broker
from tests.support.data import MAKE_GROUP_HASH, make_group
from tests.support.services import announce_key, announce_public_key_file


def test_only_the_newest_versions_are_kept_and_a_group_of_a_forgotten_one_is_refused_saying_why(redis_url, tmp_path):
    r, keys, key = redis.Redis.from_url(redis_url), Keys("r"), announce_key(tmp_path)
    for v in range(10):
        announce(r, keys, Announcement(version=v, hash=MAKE_GROUP_HASH, path=f"/weights/v{v}"), key, versions_kept=3)
    assert sorted(int(v) for v in r.hkeys(keys.versions)) == [7, 8, 9]
    b = Broker(
        BrokerConfig(
            run_id="r",
            redis_url=redis_url,
            http_port=0,
            ingest_auth="insecure",
            announce_public_key_file=str(announce_public_key_file(tmp_path)),
        )
    )
    ack = b.ingest.handle(encode_group(make_group(group_id="old")))  # weight_version 3: no longer kept
    assert ack.status == "rejected" and ack.reason == "weight_hash"
    assert "learner.publish.keep_announcements" in r.xrange(keys.dead_letter)[-1][1][b"detail"].decode()
    fresh = make_group(group_id="new", weight_version=8)
    for s in fresh.samples:
        s.version_runs = [[8, sum(n for _, n in s.version_runs)]]
    assert b.ingest.handle(encode_group(fresh)).status == "ok"


def test_the_broker_trims_the_events_stream_to_events_kept(redis_url, tmp_path):
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    b = Broker(
        BrokerConfig(
            run_id="r",
            redis_url=redis_url,
            http_port=0,
            ingest_auth="insecure",
            events_kept=100,
            announce_public_key_file=str(announce_public_key_file(tmp_path)),
        )
    )
    for i in range(1000):
        emit_event(r, keys, "applied", generator="g", version=i)
    b._trim_events()
    assert 100 <= r.xlen(keys.events) < 300  # about events_kept (trimmed by whole stream nodes), the newest kept
    assert r.xrevrange(keys.events, count=1)[0][1][b"data"] == b'{"generator": "g", "version": 999}'
