"""The replay queue keeps each group's message beside its stream entry, as ``payload:<stream id>``
(docs/protocol.md 7.3): the append script never sees the bytes. The messages must live exactly as long
as their entries: none for a busy or duplicate answer, none left after a commit or a drop, none kept
forever by an append that failed, and a missing one is a dropped group, not a crash. Real redis-server,
the real scripts."""

import redis
import pytest

from broker.client import queues
from broker.protocol.group import encode_group
from broker.protocol.keys import Keys
from deploy.launcher.summary import audit
from tests.support.data import make_group


def _append(r, keys, groups, bound=10_000, max_bytes=1 << 30):
    pipe = r.pipeline()
    queues.append_groups(pipe, keys, bound, max_bytes, [(g, encode_group(g)) for g in groups])
    return pipe.execute()[-1]


def _messages(r, keys) -> set[str]:
    return {k.decode() for k in r.scan_iter(match=keys.payload_prefix + "*")}


def _staged(r, keys) -> list[bytes]:
    return list(r.scan_iter(match=keys.staged("*")))


def test_each_queued_group_has_its_message_and_nothing_else_is_kept(redis_url):
    r, keys = redis.Redis.from_url(redis_url), Keys("pl")
    queues.ensure_groups(r, keys)
    groups = [make_group(group_id=f"g{i}", prompt_id=f"p{i}") for i in range(5)]
    res = _append(r, keys, groups[:3])
    assert all(x not in (b"B", b"D") for x in res)
    # a resend of g1 is a duplicate; with the bound at 4 unread groups, g3 gets in and g4 is busy
    again = _append(r, keys, [groups[1], groups[3], groups[4]], bound=4)
    assert again[0] == b"D" and again[2] == b"B" and again[1] == r.xrevrange(keys.trajectories, count=1)[0][0]
    entries = r.xrange(keys.trajectories)
    assert [f[b"gid"] for _, f in entries] == [b"g0", b"g1", b"g2", b"g3"]
    assert b"data" not in entries[0][1]  # the entry holds ids; its message is a key of its own
    assert _messages(r, keys) == {keys.payload(eid) for eid, _ in entries} and _staged(r, keys) == []
    # the bytes kept are exactly the bytes sent, and the queue's byte count is theirs
    assert [r.get(keys.payload(eid)) for eid, _ in entries] == [encode_group(g) for g in groups[:4]]
    assert queues.queued_bytes(r, keys) == sum(len(encode_group(g)) for g in groups[:4])
    read = queues.read_groups(r, keys)
    assert [g.group_id for _, g in read] == ["g0", "g1", "g2", "g3"]
    assert [g.prompt_id for _, g in read] == ["p0", "p1", "p2", "p3"]

    # the learner reads all four, trains two, drops one: their messages go with their entries
    reader = queues.TrajectoryReader(r, keys)
    got = reader.wait_for(4, lambda: False, timeout_s=5)
    assert [g.group_id for _, g in got] == ["g0", "g1", "g2", "g3"]
    assert queues.commit(r, keys, [(eid.decode(), g.group_id) for eid, g in got[:2]], step=1) == 2
    queues.drop(r, keys, [(got[2][0], "g2", "groups_dropped_stale")])
    assert _messages(r, keys) == {keys.payload(got[3][0])}
    assert queues.queued_bytes(r, keys) == len(encode_group(groups[3]))
    assert audit(r, keys)["lost"] == 0


def test_an_entry_whose_message_is_missing_is_read_as_undecodable(redis_url):
    r, keys = redis.Redis.from_url(redis_url), Keys("pm")
    queues.ensure_groups(r, keys)
    _append(r, keys, [make_group(group_id="a"), make_group(group_id="b")])
    first = r.xrange(keys.trajectories, count=1)[0][0]
    r.delete(keys.payload(first))
    got = queues.TrajectoryReader(r, keys).wait_for(2, lambda: False, timeout_s=5)
    assert got[0] == (first, None) and got[1][1].group_id == "b"  # the learner drops it as groups_undecodable
    queues.drop(r, keys, [(first, "", "groups_undecodable")])
    assert audit(r, keys)["lost"] == 0


def test_an_append_that_fails_leaves_its_staged_messages_to_expire(redis_url):
    r, keys = redis.Redis.from_url(redis_url), Keys("pf")
    queues.ensure_groups(r, keys)
    r.set(keys.seen, "not a set")  # the script's SADD fails: WRONGTYPE, after its messages were staged
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        _append(r, keys, [make_group(group_id="x")])
    staged = _staged(r, keys)
    assert len(staged) == 1 and 0 < r.pttl(staged[0]) <= queues.STAGED_TTL_MS
    assert r.xlen(keys.trajectories) == 0 and _messages(r, keys) == set()


def test_an_append_outside_a_transaction_is_refused(redis_url):
    r, keys = redis.Redis.from_url(redis_url), Keys("pt")
    with pytest.raises(ValueError, match="transaction"):
        queues.append_groups(r.pipeline(transaction=False), keys, 10, 1 << 20, [(make_group(), b"x")])


def test_an_entry_appended_before_the_messages_moved_out_is_still_read(redis_url):
    """A run resumed across the change keeps the groups its queue held (their message in a data field)."""
    r, keys = redis.Redis.from_url(redis_url), Keys("po")
    queues.ensure_groups(r, keys)
    g = make_group(group_id="old")
    eid = r.xadd(keys.trajectories, {"gid": "old", "data": encode_group(g), "v": g.min_version, "gen": "gen-0"})
    got = queues.TrajectoryReader(r, keys).wait_for(1, lambda: False, timeout_s=5)
    assert got[0][0] == eid and got[0][1].group_id == "old" and got[0][1].prompt_ids.tolist() == [1, 4, 14]
