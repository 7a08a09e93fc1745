"""What services report about themselves in Redis: generator heartbeats, where each ``/metrics`` is,
the dashboard's events stream, per-service counters."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from broker.protocol.keys import Keys


def heartbeat(r: redis.Redis, keys: Keys, generator_id: str, state: dict[str, Any]) -> None:
    state = dict(state, id=generator_id, last_seen=time.time())
    r.hset(keys.generators, generator_id, json.dumps(state))


def read_heartbeats(r: redis.Redis, keys: Keys) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in r.hgetall(keys.generators).items()}


def register_service(r: redis.Redis, keys: Keys, service: str, replica: str, host: str, port: int) -> None:
    """Record where a service's ``/metrics`` is (read by ``/api/prometheus/targets``)."""
    r.hset(keys.services, f"{service}:{replica}", json.dumps(
        {"service": service, "replica": replica, "host": host, "port": port, "started_at": time.time()}))


def read_services(r: redis.Redis, keys: Keys) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in r.hgetall(keys.services).items()}


def emit_event(r: redis.Redis, keys: Keys, kind: str, **fields: Any) -> None:
    """Append to the capped events stream the dashboard reads."""
    r.xadd(keys.events, {"kind": kind, "t": repr(time.time()), "data": json.dumps(fields)},
           maxlen=10_000, approximate=True)


def read_stats(r: redis.Redis, keys: Keys, service: str) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in r.hgetall(keys.stats(service)).items()}


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
    return [(eid.decode(), {k.decode(): v.decode() for k, v in f.items()}) for eid, f in entries]


def newest_id(r: redis.Redis, stream: str) -> str:
    """The id of the newest entry of ``stream`` ("0-0" when empty)."""
    last = r.xrevrange(stream, count=1)
    return last[0][0].decode() if last else "0-0"
