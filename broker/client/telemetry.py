"""What services report about themselves in Redis: generator heartbeats, where each ``/metrics`` is,
the dashboard's events stream, per-service counters."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import redis

from broker.protocol.codec import ProtocolError
from broker.protocol.keys import EVENTS_MAX, Keys
from broker.protocol.messages import Event, Heartbeat, ServiceEndpoint, decode_heartbeat, encode_heartbeat

log = logging.getLogger(__name__)


def heartbeat(r: redis.Redis, keys: Keys, hb: Heartbeat) -> None:
    """Write generator ``hb.id``'s heartbeat, stamped ``last_seen`` = now."""
    r.hset(keys.generators, hb.id, encode_heartbeat(hb.model_copy(update={"last_seen": time.time()})))


class Heartbeats(dict[str, Heartbeat]):
    """Generator id -> its last heartbeat, for every readable entry. ``malformed``: id -> what is
    wrong with each entry that could not be read (skipped, so one bad producer cannot break the
    dashboard, ``/metrics`` or a run's summary; counted there as ``malformed_heartbeats``)."""

    def __init__(self, good: dict[str, Heartbeat], malformed: dict[str, str]):
        super().__init__(good)
        self.malformed = malformed


_reported: set[tuple[str, bytes]] = set()  # malformed entries already logged by this process


def _warn_once(key: str, value: bytes, msg: str, *args) -> None:
    """Log a malformed entry once, not at every read (a bounded memory of what was logged)."""
    if (key, value) in _reported:
        return
    if len(_reported) > 1000:
        _reported.clear()
    _reported.add((key, value))
    log.warning(msg, *args)


def read_heartbeats(r: redis.Redis, keys: Keys) -> Heartbeats:
    good, bad = {}, {}
    for k, v in r.hgetall(keys.generators).items():
        gid = k.decode(errors="replace")
        try:
            good[gid] = decode_heartbeat(v)
        except ProtocolError as e:
            bad[gid] = e.detail
            _warn_once(gid, v, "skipped the malformed heartbeat of %r: %s (entry starts %r)", gid, e.detail, v[:80])
    return Heartbeats(good, bad)


def register_service(r: redis.Redis, keys: Keys, service: str, replica: str, host: str, port: int) -> None:
    """Record where a service's ``/metrics`` is (read by ``/api/prometheus/targets``)."""
    r.hset(
        keys.services,
        f"{service}:{replica}",
        ServiceEndpoint(service, replica, host, port, started_at=time.time()).encode(),
    )


def read_services(r: redis.Redis, keys: Keys) -> dict[str, ServiceEndpoint]:
    """ "service:replica" -> where its /metrics is; an unreadable entry is skipped and logged."""
    out = {}
    for k, v in r.hgetall(keys.services).items():
        try:
            out[k.decode()] = ServiceEndpoint.decode(v)
        except ProtocolError as e:
            log.warning("skipped the unreadable service entry %r: %s", k, e.detail)
    return out


def emit_event(r: redis.Redis, keys: Keys, kind: str, **fields: Any) -> None:
    """Append to the capped events stream the dashboard reads."""
    r.xadd(keys.events, Event(kind, time.time(), fields).fields(), maxlen=EVENTS_MAX, approximate=True)


def read_events(r: redis.Redis, keys: Keys, after: str | None, limit: int) -> list[tuple[str, Event]]:
    """Events after stream id ``after`` (as :func:`read_after`), oldest first; an entry whose time is not
    a finite number or whose data is not an object is skipped (logged once)."""
    out = []
    for eid, f in read_after(r, keys.events, after, limit):
        try:
            e = Event.from_fields(f)
            if not math.isfinite(e.t) or not isinstance(e.data, dict):
                raise ValueError(f"t {e.t!r:.40} / data {type(e.data).__name__}")
        except ValueError as err:
            _warn_once("events", eid.encode(), "skipped the malformed event %s: %s", eid, err)
            continue
        out.append((eid, e))
    return out


class Stats(dict[str, float]):
    """A service's counters (field -> number). ``malformed``: field -> what is wrong with each value
    that is not a finite number (skipped, logged once, counted where the state is shown)."""

    def __init__(self, good: dict[str, float], malformed: dict[str, str]):
        super().__init__(good)
        self.malformed = malformed


def read_stats(r: redis.Redis, keys: Keys, service: str) -> Stats:
    good, bad = {}, {}
    for k, v in r.hgetall(keys.stats(service)).items():
        name = k.decode(errors="replace")
        try:
            x = float(v)
            if not math.isfinite(x):
                raise ValueError(f"{x} is not finite")
            good[name] = x
        except ValueError as e:  # garbage bytes, not a number, NaN or inf
            bad[name] = f"not a finite number: {str(e)[:80]}"
            _warn_once(f"stats:{service}:{name}", v, "skipped the malformed %s stat %r: %r", service, name, v[:80])
    return Stats(good, bad)


def add_learner_step(r: redis.Redis, keys: Keys, step: int, data: str, keep: int) -> None:
    """One step's metrics (JSON) into the capped ``learner_metrics`` stream (the dashboard's charts)."""
    r.xadd(keys.learner_metrics, {"step": step, "data": data}, maxlen=keep, approximate=True)


def read_after(r: redis.Redis, stream: str, after: str | None, limit: int) -> list[tuple[str, dict]]:
    """Entries of a capped stream (events, learner metrics) after ``after`` (exclusive), oldest first;
    without ``after`` the newest ``limit``."""
    if after:
        entries = r.xrange(stream, min=f"({after}", max="+", count=limit)
    else:
        entries = list(reversed(r.xrevrange(stream, max="+", min="-", count=limit)))
    return [
        (eid.decode(), {k.decode(errors="replace"): v.decode(errors="replace") for k, v in f.items()})
        for eid, f in entries
    ]


def newest_id(r: redis.Redis, stream: str) -> str:
    """The id of the newest entry of ``stream`` ("0-0" when empty)."""
    last = r.xrevrange(stream, count=1)
    return last[0][0].decode() if last else "0-0"
