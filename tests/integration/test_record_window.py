"""The run's records are bounded by a window of group ids, the audit is not: the broker's de-duplication
set and the learner's commit set each keep the last ``record_window`` to 2 x ``record_window`` ids (two
generations, the older dropped when the newer fills), the commit and drop logs about the window's newest
entries, while the counters the audit adds up (accepted, committed, dropped, queued) stay exact for the
whole run. Real redis-server, the real scripts (broker/protocol/scripts.py), a window of 4."""

import redis

from broker.client import queues
from broker.protocol.group import encode_group
from broker.protocol.keys import TRAJECTORIES_GROUP, Keys
from deploy.launcher.summary import audit
from tests.support.data import make_group

W = 4


def _append(r, keys, gids: list[str]) -> list[bytes]:
    pipe = r.pipeline()
    queues.append_groups(pipe, keys, 10_000, 1 << 30, [(g, encode_group(g)) for g in map(_g, gids)], window=W)
    return pipe.execute()[-1]


def _g(gid: str):
    return make_group(group_id=gid)


def _read(r, keys, n: int) -> list[tuple[str, str]]:
    resp = r.xreadgroup(TRAJECTORIES_GROUP, "learner-0", {keys.trajectories: ">"}, count=n)
    return [(eid.decode(), f[b"gid"].decode()) for _, entries in resp for eid, f in entries]


def _ids(r, key) -> set[str]:
    return {m.decode() for m in r.smembers(key)}


def test_the_dedup_and_commit_records_stay_within_two_windows_and_the_audit_stays_exact(redis_url):
    r, keys = redis.Redis.from_url(redis_url), Keys("w")
    queues.ensure_groups(r, keys)
    gids = [f"g{i:02d}" for i in range(20)]
    for k in range(0, 20, 3):  # batches of 3: the generation turns over inside and between batches
        assert all(x not in (b"B", b"D") for x in _append(r, keys, gids[k : k + 3]))
        remembered = _ids(r, keys.seen) | _ids(r, keys.seen_prev)
        assert len(remembered) <= 2 * W + 2 and set(gids[max(0, k + 3 - W) : k + 3]) <= remembered
    assert _append(r, keys, ["g19", "g17"]) == [b"D", b"D"]  # a recent resend is a duplicate
    assert _append(r, keys, ["g00"])[0] not in (b"B", b"D")  # long forgotten: taken as new (the window's price)
    assert int(r.hget(keys.stats("broker"), "accepted")) == 21 and int(r.hget(keys.stats("broker"), "duplicate")) == 2

    # the learner: 15 trained and committed (in commits of 5), 3 dropped, 3 left in the stream
    read = _read(r, keys, 21)
    for k in range(0, 15, 5):
        assert queues.commit(r, keys, read[k : k + 5], step=k // 5 + 1, window=W) == 5
        assert len(_ids(r, keys.trained) | _ids(r, keys.trained_prev)) <= 2 * W + 4
    assert queues.commit(r, keys, read[10:15], step=4, window=W) == 0  # a restart commits again: nothing new
    queues.drop(r, keys, [(eid, gid, "groups_dropped_stale") for eid, gid in read[15:18]], window=W)
    a = audit(r, keys)
    assert a == {
        "produced": 21,
        "trained_once": 15,
        "trained_twice": 0,
        "dropped": 3,
        "queued": 3,
        "rejected": 0,
        "duplicates_ignored": 2,
        "lost": 0,
    }, a
    # the counters do not depend on what is remembered: forget every record, the audit is the same
    r.delete(keys.seen, keys.seen_prev, keys.trained, keys.trained_prev, keys.trained_log, keys.dropped_log)
    assert audit(r, keys) == a


def test_window_0_remembers_the_whole_run(redis_url):
    r, keys = redis.Redis.from_url(redis_url), Keys("w0")
    queues.ensure_groups(r, keys)
    pipe = r.pipeline()
    queues.append_groups(
        pipe, keys, 10_000, 1 << 30, [(g, encode_group(g)) for g in map(_g, map(str, range(30)))], window=0
    )
    pipe.execute()
    assert r.scard(keys.seen) == 30 and not r.exists(keys.seen_prev)
    read = _read(r, keys, 30)
    assert queues.commit(r, keys, read, step=1, window=0) == 30
    assert r.scard(keys.trained) == 30 and r.xlen(keys.trained_log) == 30 and not r.exists(keys.trained_prev)
