"""What a run announces to its producers: weight versions (the latest published version in a key,
every version's hash in a hash, and a pub/sub message to wake subscribers; written by the learner,
read by generators, the broker and the dashboard), and the run's advertisement (``run``: how to join
it, each field written by the service that knows it)."""

from __future__ import annotations

from typing import Any

import redis

from broker.protocol.keys import Keys
from broker.protocol.messages import (Announcement, RunInfo, decode_announcement, decode_run_info,
                                      encode_announcement, encode_run_fields)


def announce(r: redis.Redis, keys: Keys, a: Announcement) -> None:
    """Make version ``a.version`` the latest (a key), record its hash in ``versions`` (so anyone can
    check the hash a generator serves for any version), and tell subscribers (pub/sub)."""
    data = encode_announcement(a)
    pipe = r.pipeline()
    pipe.set(keys.latest, data)
    pipe.hset(keys.versions, str(a.version), a.hash)
    pipe.publish(keys.announce, data)
    pipe.execute()


def announced_runs(r: redis.Redis) -> list[str]:
    """Every run in this Redis that has announced a version."""
    return sorted({Keys.run_of(k.decode()) for k in r.scan_iter(Keys("*").latest)})


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


def advertise_run(r: redis.Redis, keys: Keys, first_writer_wins: bool = False, **values: Any) -> dict[str, Any]:
    """Write these RunInfo fields of the run's advertisement. ``first_writer_wins``: keep a value
    already there (HSETNX; the first generator's reward URL and sampling are the run's). Returns the
    fields whose advertised value differs from the one given (field -> advertised value)."""
    fields = encode_run_fields(**values)
    if not first_writer_wins:
        r.hset(keys.run, mapping=fields)
        return {}
    pipe = r.pipeline()
    for k, v in fields.items():
        pipe.hsetnx(keys.run, k, v)
    pipe.execute()
    now = read_run_info(r, keys)
    return {k: getattr(now, k) for k, v in values.items() if getattr(now, k) != v}


def read_run_info(r: redis.Redis, keys: Keys) -> RunInfo:
    """What a producer needs to join the run (fields nobody wrote yet are empty)."""
    return decode_run_info(r.hgetall(keys.run))
