"""Control messages: the broker's ack of a group, and a published weight version's announcement.

Each is a msgpack map with a ``kind`` tag (``ack``, ``announce``), encoded and decoded only here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgpack

from broker.protocol.codec import SCHEMA_VERSION, ProtocolError, get_field, unpack_map

ACK_STATUSES = ("ok", "duplicate", "rejected", "busy")


# ----------------------------------------------------------------------------------------------
# ack (broker -> generator)


@dataclass
class Ack:
    """The broker's reply to one group.

    status: "ok" (appended), "duplicate" (already appended earlier; safe, do not resend),
            "rejected" (invalid; do not resend), "busy" (queue full; resend later).
    reason: the rejection reason code, or "" otherwise.
    stream_id: the Redis stream entry id when appended.
    """

    group_id: str
    status: str
    reason: str = ""
    stream_id: str = ""


def encode_ack(a: Ack) -> bytes:
    return msgpack.packb(
        {"schema": SCHEMA_VERSION, "kind": "ack", "group_id": a.group_id, "status": a.status,
         "reason": a.reason, "stream_id": a.stream_id},
        use_bin_type=True,
    )


def decode_ack(data: bytes) -> Ack:
    m = unpack_map(data)
    if m.get("kind") != "ack" or m.get("status") not in ACK_STATUSES:
        raise ProtocolError("bad_ack", f"not an ack: {m!r:.200}")
    return Ack(str(m.get("group_id", "")), m["status"], str(m.get("reason", "")), str(m.get("stream_id", "")))


# ----------------------------------------------------------------------------------------------
# weight announcement (learner -> generators, Redis key + pub/sub)


@dataclass
class Announcement:
    """A published weight version.

    version: integer that only grows.
    hash:    sha256 of the version's manifest (identifies the exact weights).
    path:    folder of the snapshot in the weight store (shared volume).
    url:     optional HTTP base URL serving the same folder.
    published_at: unix time.
    """

    version: int
    hash: str
    path: str
    url: str = ""
    published_at: float = field(default_factory=time.time)


def encode_announcement(a: Announcement) -> bytes:
    return msgpack.packb(
        {"schema": SCHEMA_VERSION, "kind": "announce", "version": a.version, "hash": a.hash,
         "path": a.path, "url": a.url, "published_at": a.published_at},
        use_bin_type=True,
    )


def decode_announcement(data: bytes) -> Announcement:
    m = unpack_map(data)
    if m.get("kind") != "announce":
        raise ProtocolError("bad_kind", "not an announcement")
    return Announcement(
        version=get_field(m, "version", int, "announce"),
        hash=get_field(m, "hash", str, "announce"),
        path=get_field(m, "path", str, "announce"),
        url=str(m.get("url", "")),
        published_at=float(m.get("published_at", 0.0)),
    )
