"""Weight announcements: the latest published version (a key), every version's hash (a hash), and
a pub/sub message to wake subscribers. Written by the learner, read by generators, the broker and
the dashboard."""

from __future__ import annotations

import redis

from broker.protocol.keys import Keys
from broker.protocol.messages import Announcement, decode_announcement, encode_announcement


def announce(r: redis.Redis, keys: Keys, a: Announcement) -> None:
    """Make version ``a.version`` the latest (a key), record its hash in ``versions`` (so anyone can
    check the hash a generator serves for any version), and tell subscribers (pub/sub)."""
    data = encode_announcement(a)
    pipe = r.pipeline()
    pipe.set(keys.latest, data)
    pipe.hset(keys.versions, str(a.version), a.hash)
    pipe.publish(keys.announce, data)
    pipe.execute()


def latest_announcement(r: redis.Redis, keys: Keys) -> Announcement | None:
    data = r.get(keys.latest)
    return decode_announcement(data) if data else None


def announced_hashes(r: redis.Redis, keys: Keys, versions: list[int]) -> dict[int, str | None]:
    """The hash announced for each of ``versions`` (None when that version was never announced)."""
    versions = sorted(set(versions))
    if not versions:
        return {}
    got = r.hmget(keys.versions, [str(v) for v in versions])
    return {v: (h.decode() if h is not None else None) for v, h in zip(versions, got)}
