"""What a run announces to its producers: weight versions (the latest published version in a key,
every version's hash in a hash, and a pub/sub message to wake subscribers; written by the learner,
read by generators, the broker and the dashboard), and the run's advertisement (``run``: how to join
it, each field written by the service that knows it).

Announcements are signed by the learner with the run's private key (Ed25519, broker/protocol/signing.py).
A reader given the public key sees only verified ones: under a forged ``latest`` (unsigned, or signed with
another key) the latest is the newest signed entry of ``versions`` (:func:`checked_latest` says what
was forged), and a forged ``versions`` entry reads as a version never announced."""

from __future__ import annotations

from typing import Any

import redis

from broker.protocol import signing
from broker.protocol.codec import ProtocolError
from broker.protocol.keys import Keys
from broker.protocol.messages import (
    Announcement,
    RunInfo,
    decode_announcement,
    decode_run_info,
    encode_announcement,
    encode_run_fields,
)


class ForgedAnnouncement(Exception):
    """An announcement in Redis that the run's private key did not sign. ``reason``: ``unsigned`` or
    ``bad_signature``; ``announcement``: what it claims."""

    def __init__(self, announcement: Announcement, reason: str):
        super().__init__(f"{reason}: version {announcement.version} ({announcement.hash[:12]}) at {announcement.path}")
        self.announcement, self.reason = announcement, reason


def announce(
    r: redis.Redis, keys: Keys, a: Announcement, key: signing.AnnounceSigner | None = None, versions_kept: int = 0
) -> None:
    """Make version ``a.version`` the latest (a key), record it in ``versions`` (so anyone can
    check the hash a generator serves for a recent version), and tell subscribers (pub/sub); signed
    with ``key`` (the run's announcement key) when given. ``versions_kept`` > 0: the record of version
    ``a.version - versions_kept`` is deleted, so ``versions`` holds the newest ``versions_kept``
    (versions are announced in order, one apart: learner.publish.keep_announcements)."""
    data = encode_announcement(signing.signed(key, keys.run_id, a))
    pipe = r.pipeline()
    pipe.set(keys.latest, data)
    pipe.hset(keys.versions, str(a.version), data)
    if versions_kept > 0 and a.version >= versions_kept:
        pipe.hdel(keys.versions, str(a.version - versions_kept))
    pipe.publish(keys.announce, data)
    pipe.execute()


def record(r: redis.Redis, keys: Keys, a: Announcement, key: bytes | None = None) -> None:
    """Record version ``a.version``'s announcement in ``versions`` (signed with ``key``) without making it
    the latest or telling subscribers: an older version announced again (learner/publish.py readvertise)."""
    r.hset(keys.versions, str(a.version), encode_announcement(signing.signed(key, keys.run_id, a)))


def announced_runs(r: redis.Redis) -> list[str]:
    """Every run in this Redis that has announced a version."""
    return sorted({Keys.run_of(k.decode()) for k in r.scan_iter(Keys("*").latest)})


def checked_latest(r: redis.Redis, keys: Keys, key: signing.AnnounceVerifier | None) -> Announcement | None:
    """The latest announcement (None before the first); with ``key``, ForgedAnnouncement when the
    key did not sign it."""
    data = r.get(keys.latest)
    if not data:
        return None
    a = decode_announcement(data)
    why = signing.check(key, keys.run_id, a) if key is not None else None
    if why is not None:
        raise ForgedAnnouncement(a, why)
    return a


def latest_announcement(r: redis.Redis, keys: Keys, key: signing.AnnounceVerifier | None = None) -> Announcement | None:
    """The latest announcement; with ``key``, the newest one that key signed (``latest``, or when
    someone overwrote it, the newest signed entry of ``versions``)."""
    try:
        return checked_latest(r, keys, key)
    except ForgedAnnouncement:
        return newest_signed(r, keys, key)


def newest_signed(r: redis.Redis, keys: Keys, key: signing.AnnounceVerifier) -> Announcement | None:
    """The newest entry of ``versions`` signed by ``key`` (None when there is none)."""
    best = None
    for field, raw in r.hgetall(keys.versions).items():
        try:
            a = decode_announcement(raw)
        except ProtocolError:
            continue  # a bare hash (a run from before signing) or garbage: not signed
        if (
            str(a.version).encode() == field
            and signing.check(key, keys.run_id, a) is None
            and (best is None or a.version > best.version)
        ):
            best = a
    return best


def announced_hashes(
    r: redis.Redis, keys: Keys, versions: list[int], key: signing.AnnounceVerifier | None = None
) -> dict[int, str | None]:
    """The hash announced for each of ``versions`` (None when that version was never announced,
    or, with ``key``, when its entry is not signed by that key or cannot be read)."""
    versions = sorted(set(versions))
    if not versions:
        return {}
    got = r.hmget(keys.versions, [str(v) for v in versions])
    return {v: _entry_hash(keys, v, raw, key) for v, raw in zip(versions, got)}


def signed_announcement(
    r: redis.Redis, keys: Keys, version: int, key: signing.AnnounceVerifier | None = None
) -> Announcement | None:
    """The announcement of ``version`` (None when it was never announced, or, with ``key``, when its
    entry is not signed by that key or cannot be read)."""
    return _entry(keys, version, r.hget(keys.versions, str(version)), key)


def _entry(keys: Keys, version: int, raw: bytes | None, key: signing.AnnounceVerifier | None) -> Announcement | None:
    """The ``versions`` entry ``raw`` of ``version`` when it is that version's (and ``key`` signed it)."""
    if raw is None:
        return None
    try:
        a = decode_announcement(raw)
    except ProtocolError:
        return None
    if a.version != version or (key is not None and signing.check(key, keys.run_id, a) is not None):
        return None
    return a


def _entry_hash(keys: Keys, version: int, raw: bytes | None, key: signing.AnnounceVerifier | None) -> str | None:
    a = _entry(keys, version, raw, key)
    if a is None and raw is not None and key is None:
        try:
            decode_announcement(raw)
        except ProtocolError:  # a bare hash: how runs recorded versions before announcements were signed
            return raw.decode(errors="replace")
    return a.hash if a is not None else None


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
