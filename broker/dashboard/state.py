"""The run's state as the dashboard, ``/api/state`` and ``relay status`` show it, read from Redis.

Everything here reads Redis only (no service internals), so any process that can reach the run's
Redis can build it: the broker serves it over HTTP, ``relay status --redis-url`` prints it.

A generator's shown ``state`` is the one its last heartbeat reported (``sampling``, ``updating``,
``paused_staleness``, ``paused_backpressure``, ``paused_reward``, ``draining``, ``stopped``, ...), except ``dead``
when that heartbeat is older than ``dead_after_s`` and the generator did not report ``stopped``.
``hash_ok`` is false when the hash it serves differs from the one announced for its version: the
bug a glance must catch (a sync never delivered, a version stamp ahead of the weights).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque

import redis

from broker.client.connection import split_addresses
from broker.client.announcements import ForgedAnnouncement, announced_hashes, checked_latest, newest_signed
from broker.client import queues
from broker.client.telemetry import read_after, read_events, read_heartbeats, read_stats
from broker.protocol.keys import Keys
from broker.protocol.messages import Heartbeat
from broker.protocol.signing import AnnounceVerifier

log = logging.getLogger("relay.broker.state")


def shown_state(hb: Heartbeat, now: float, dead_after_s: float) -> str:
    """The state to display for one heartbeat: the reported one, or ``dead`` when it is too old."""
    if hb.state != "stopped" and (hb.last_seen is None or now - hb.last_seen > dead_after_s):
        return "dead"
    return hb.state


def _prefixed(stats: dict[str, float], prefix: str) -> dict[str, int]:
    return {k[len(prefix) :]: int(v) for k, v in sorted(stats.items()) if k.startswith(prefix)}


def build_state(
    r: redis.Redis,
    keys: Keys,
    dead_after_s: float = 10.0,
    rates: dict | None = None,
    now: float | None = None,
    announce_key: AnnounceVerifier | None = None,
) -> dict:
    """The whole state (see docs/dashboard.md for every field). ``rates`` is the broker's
    throughput estimate (``groups_in_per_s``, ``groups_out_per_s``); None outside the broker.
    With ``announce_key``, only announcements it signed count: a forged ``latest`` is shown in
    ``flags.forged_announcement`` (the learner's version is then the newest signed one), a forged
    ``versions`` entry as a version never announced."""
    now = time.time() if now is None else now
    forged = None
    try:
        latest = checked_latest(r, keys, announce_key)
    except ForgedAnnouncement as e:
        latest = newest_signed(r, keys, announce_key)
        a = e.announcement
        forged = {"reason": e.reason, "version": a.version, "hash": a.hash, "path": a.path}
    lv = latest.version if latest else None
    heartbeats = read_heartbeats(r, keys)
    served = [hb.version for hb in heartbeats.values() if hb.version is not None]
    announced = announced_hashes(r, keys, served, announce_key)
    if latest is not None and announced.get(latest.version) is None:  # announced before `versions` existed
        announced[latest.version] = latest.hash
    gens = []
    for gid, hb in sorted(heartbeats.items()):
        v = hb.version
        expected = announced.get(v) if v is not None else None
        gens.append(
            {
                "id": gid,
                "backend": hb.backend,
                "version": v,
                "hash": hb.hash,
                "announced_hash": expected,
                # a version served whose announced hash is known and differs: flagged red
                "hash_ok": v is None or expected is None or hb.hash == expected,
                "lag": (lv - v) if lv is not None and v is not None else None,
                "last_seen": hb.last_seen,
                "age_s": round(now - hb.last_seen, 3) if hb.last_seen is not None else None,
                "state": shown_state(hb, now, dead_after_s),
                "reported_state": hb.state,
                "last_update_latency_s": hb.last_update_latency_s,
                "tokens_per_s": hb.tokens_per_s,
                "tokens": hb.tokens,
                "groups_sent": hb.groups_sent,
                "groups_rejected": hb.groups_rejected,
                "updates": hb.updates,
                "refused_updates": hb.refused_updates,
                "forged_announcements": hb.forged_announcements,
                "refused": hb.refused,
                "reward_ok": hb.reward_ok,
                "reward_failures": hb.reward_failures,
                "reward_failures_by_plugin": hb.reward_failures_by_plugin,
                "reward_last_failure": hb.reward_last_failure,
                "reward_pauses": hb.reward_pauses,
                "reward_paused_s": hb.reward_paused_s,
                "metrics_port": hb.metrics_port,
                "episodes": hb.episodes,
            }
        )
    learner = read_stats(r, keys, "learner")
    broker = read_stats(r, keys, "broker")
    reward_failures: dict[str, int] = {}
    last_failure: dict[str, str] = {}  # plugin -> a latest reason (the last generator's, in id order, that has one)
    for g in gens:
        for plugin, n in g["reward_failures_by_plugin"].items():
            reward_failures[plugin] = reward_failures.get(plugin, 0) + int(n)
        last_failure.update(g["reward_last_failure"])
    return {
        "run_id": keys.run_id,
        "time": now,
        "learner_version": lv,
        "learner_hash": latest.hash if latest else None,
        "learner_published_at": latest.published_at if latest else None,
        "learner": learner,
        "generators": gens,
        # "insecure": any process that reaches the ingest can send groups (shown on the page); null
        # before the broker started
        "ingest_auth": (r.hget(keys.run, "ingest_auth") or b"").decode() or None,
        # one per broker ingest worker (broker.ingest_workers); [] before the broker started
        "ingest_addresses": split_addresses((r.hget(keys.run, "ingest_addresses") or b"").decode()),
        "queue_depth": queues.waiting_groups(r, keys),
        "queue_bytes": queues.queued_bytes(r, keys),
        "pending_groups": queues.pending_groups(r, keys),
        "prompts_ready": queues.prompts_ready(r, keys),
        "rates": rates or {},
        "broker": broker,
        "episodes": episode_totals([g["episodes"] for g in gens]),
        "failures": {
            "rejected": _prefixed(broker, "rejected:"),
            "learner_dropped": {
                k: int(v)
                for k, v in sorted(learner.items())
                if k.startswith("groups_dropped_") or k == "groups_undecodable"
            },
            # optimizer steps skipped and publications refused for NaN/inf (docs/learner.md)
            "learner_nonfinite": {
                k: int(learner[k]) for k in ("skipped_steps", "publish_refused_nonfinite") if k in learner
            },
            "reward_failures_by_plugin": dict(sorted(reward_failures.items())),
            "reward_failures": sum(int(g["reward_failures"] or 0) for g in gens),
            "reward_last_failure": dict(sorted(last_failure.items())),
            # reward outages that held a batch (generators in state paused_reward meanwhile; docs/rewards.md)
            "reward_pauses": sum(int(g["reward_pauses"] or 0) for g in gens),
            "refused_updates": sum(int(g["refused_updates"] or 0) for g in gens),
            "forged_announcements": sum(int(g["forged_announcements"] or 0) for g in gens),
            # heartbeat entries that could not be read (skipped above; the reader logs why)
            "malformed_heartbeats": dict(sorted(heartbeats.malformed.items())),
            # stats fields whose value is not a finite number ("service:field" -> why; skipped above)
            "malformed_stats": {
                f"{svc}:{k}": why
                for svc, st in (("broker", broker), ("learner", learner))
                for k, why in sorted(st.malformed.items())
            },
            # records skipped at this read, by kind (the broker adds eval_results and eval_rounds)
            "malformed_records": {
                "heartbeats": len(heartbeats.malformed),
                "stats": len(broker.malformed) + len(learner.malformed),
            },
        },
        "flags": {
            "hash_mismatch": [g["id"] for g in gens if not g["hash_ok"]],
            "dead": [g["id"] for g in gens if g["state"] == "dead"],
            # the announcement in Redis now is not signed by the run's key (null when it is, or unchecked)
            "forged_announcement": forged,
            # generators that saw (and ignored) a forged announcement
            "forged_seen": [g["id"] for g in gens if g["forged_announcements"]],
        },
        "done": bool(r.exists(keys.done)),
    }


# ----------------------------------------------------------------------------------------------
# histories for the charts


def learner_history(r: redis.Redis, keys: Keys, after: str | None = None, limit: int = 2000) -> list[dict]:
    """Per-step learner metrics, each ``{"id": stream id, **metrics}`` (see learner/observe.py)."""
    out = []
    for eid, f in read_after(r, keys.learner_metrics, after, limit):
        try:  # strict JSON objects only: a NaN in one entry would make the page's JSON unreadable
            entry = json.loads(f.get("data", "{}"))
            if not isinstance(entry, dict):
                raise ValueError(f"a {type(entry).__name__}, not an object")
            json.dumps(entry, allow_nan=False)  # ValueError on NaN or ±inf (also 1e999, parsed as inf)
            out.append({"id": eid, **entry})
        except ValueError:  # JSONDecodeError is a ValueError
            out.append({"id": eid, "error": "unreadable entry"})
    return out


def events_history(r: redis.Redis, keys: Keys, after: str | None = None, limit: int = 2000) -> list[dict]:
    """Events (published, applied, refused), each ``{"id", "kind", "t", **data}``."""
    return [{"id": eid, "kind": e.kind, "t": e.t, **e.data} for eid, e in read_events(r, keys, after, limit)]


class Throughput:
    """Samples the queue and the group counters every ``every_s`` seconds (a thread in the broker)
    and derives groups/s in (accepted by the broker) and out (consumed by the learner: trained or
    dropped). Keeps the last ``keep`` samples for the charts; they live in the broker's memory
    only (restarting the broker starts the throughput chart afresh)."""

    def __init__(self, r: redis.Redis, keys: Keys, every_s: float = 1.0, keep: int = 3600, window_s: float = 10.0):
        self.r, self.keys, self.every_s, self.window_s = r, keys, every_s, window_s
        self.samples: deque[dict] = deque(maxlen=keep)
        self.lock = threading.Lock()
        self.errors = 0

    def sample(self) -> dict:
        pipe = self.r.pipeline()
        pipe.hget(self.keys.stats("broker"), "accepted")
        pipe.hget(self.keys.stats("learner"), "consumed")
        accepted, consumed = pipe.execute()
        depth = queues.queued_groups(self.r, self.keys)
        pending = queues.pending_groups(self.r, self.keys)
        s = {
            "t": round(time.time(), 3),
            "accepted": int(accepted or 0),
            "consumed": int(consumed or 0),
            "queue_depth": max(0, int(depth) - pending),
            "pending": pending,
        }
        with self.lock:
            old = next((o for o in reversed(self.samples) if s["t"] - o["t"] >= self.window_s), None)
            if old is None and self.samples:
                old = self.samples[0]
            dt = s["t"] - old["t"] if old else 0.0
            s["in_per_s"] = round((s["accepted"] - old["accepted"]) / dt, 3) if dt > 0 else 0.0
            s["out_per_s"] = round((s["consumed"] - old["consumed"]) / dt, 3) if dt > 0 else 0.0
            self.samples.append(s)
        return s

    def rates(self) -> dict:
        with self.lock:
            last = self.samples[-1] if self.samples else None
        return {"groups_in_per_s": last["in_per_s"], "groups_out_per_s": last["out_per_s"]} if last else {}

    def history(self, after: float | None = None) -> list[dict]:
        with self.lock:
            return [s for s in self.samples if after is None or s["t"] > after]

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.every_s):
            try:
                self.sample()
            except redis.RedisError as e:  # Redis restarting: the chart has a gap, the broker goes on
                self.errors += 1
                if self.errors % 30 == 1:
                    log.warning("throughput sampling failed (%d so far): %s", self.errors, e)

    def start(self, stop: threading.Event) -> threading.Thread:
        t = threading.Thread(target=self.run, args=(stop,), name="throughput", daemon=True)
        t.start()
        return t


def episode_totals(per_generator: list[dict]) -> dict:
    """Multi-turn episodes over every generator (docs/agents.md), from their heartbeats' ``episodes``:
    counts summed, tool calls and failures by tool and environment failures by reason merged, and the
    means a user reads (turns per episode, environment seconds per episode). Empty when no generator
    runs episodes (a single-turn task)."""
    out: dict = {
        "episodes": 0,
        "turns": 0,
        "env_seconds": 0.0,
        "template_drift": 0,
        "unspellable_replies": 0,
        "tool_calls": {},
        "tool_failures": {},
        "env_failures": {},
    }
    for e in per_generator:
        if not e:
            continue
        for k in ("episodes", "turns", "template_drift", "unspellable_replies"):
            out[k] += int(e.get(k) or 0)
        out["env_seconds"] += float(e.get("env_seconds") or 0.0)
        for k in ("tool_calls", "tool_failures", "env_failures"):
            for name, n in (e.get(k) or {}).items():
                out[k][name] = out[k].get(name, 0) + int(n)
    if not out["episodes"]:
        return {}
    out["turns_per_episode"] = out["turns"] / out["episodes"]
    out["env_seconds_per_episode"] = out["env_seconds"] / out["episodes"]
    return out
