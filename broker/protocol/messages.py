"""Every message between services except the group (group.py), each defined once, here:

    Ack           broker -> generator       msgpack map, ``kind`` "ack"       (ZeroMQ reply to a group)
    Announcement  learner -> generators     msgpack map, ``kind`` "announce"  (Redis key + pub/sub)
    Heartbeat     generator -> everyone     JSON object                       (Redis hash ``generators``)
    RunInfo       broker, generators, learner -> producers  Redis hash fields (``run``: how to join a run)
    ItemIn, ScoreRequest, ResultOut, ScoreResponse  generator <-> reward service  JSON over HTTP (POST /score)

Control messages (ack, announce) carry a ``kind`` tag; the others are state (a heartbeat, the run's
advertisement) or the body of one HTTP route, so their place says what they are. docs/protocol.md
specifies the bytes; tests/snapshots/reward_openapi.json pins the reward service's JSON.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


# ----------------------------------------------------------------------------------------------
# heartbeat (generator -> dashboard, relay status, relay up, the learner's pruning; Redis hash)


class Heartbeat(BaseModel):
    """A generator's report of itself: JSON in the hash ``generators`` under its id, written at most
    every ``heartbeat_s``, right after a weight change, and once more (``stopped``) on exit.

    Reading is forgiving about what is absent (a producer in another language may write only
    ``version`` and ``last_seen``: the rest take these defaults) and unknown keys (ignored), strict
    about the types of what is present: a wrong type makes the whole entry malformed."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str = Field("", description="str: the producer id (also the hash field and its consumer name)")
    version: int | None = Field(None, description="int or null: the weight version served (null before the first "
                                "load); keeps that snapshot from being pruned while the heartbeat is recent")
    hash: str = Field("", description="str: the manifest hash of the version served")
    last_seen: float | None = Field(None, description="float: unix time of this heartbeat (null/absent: shown dead, "
                                    "pins nothing)")
    state: str = Field("unknown", description="str: starting, waiting_for_weights, updating, sampling, sending, "
                       "paused_staleness, paused_backpressure, draining, stopped")
    backend: str = Field("", description="str: the inference backend (torch, vllm, sglang, simulated)")
    sink_state: str = Field("", description="str: what the thread that scores and sends is doing: idle, scoring, "
                            "sending, paused_backpressure")
    in_flight: str = Field("", description="str: the in-flight policy, finish or continue")
    engine: dict[str, Any] = Field(default_factory=dict, description="object: the inference engine's identity "
                                   "(pid, ...); the same across updates = weights applied in place")
    tokens_per_s: float = Field(0.0, description="float: completion tokens per second of the last batch")
    refused: dict[str, str] = Field(default_factory=dict, description="object: manifest hash -> reason, the last 3 "
                                    "versions refused")
    metrics_port: int | None = Field(None, description="int: the port of its /metrics")
    groups_sent: int = Field(0, description="int: groups acknowledged ok or duplicate")
    groups_rejected: int = Field(0, description="int: groups the broker rejected")
    tokens: int = Field(0, description="int: completion tokens sampled")
    updates: int = Field(0, description="int: weight versions applied")
    refused_updates: int = Field(0, description="int: weight versions refused (failed verification)")
    reward_failures: int = Field(0, description="int: samples whose reward failed")
    reward_failures_by_plugin: dict[str, int] = Field(default_factory=dict, description="object: plugin -> samples "
                                                      "whose reward failed")
    last_update_latency_s: float | None = Field(None, description="float: publish -> apply seconds of the last "
                                                "update")


def encode_heartbeat(hb: Heartbeat) -> str:
    return hb.model_dump_json()


def decode_heartbeat(data: bytes | str) -> Heartbeat:
    """A heartbeat, or ProtocolError ``bad_heartbeat`` naming what is wrong with it."""
    try:
        return Heartbeat.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(the entry)"
        raise ProtocolError("bad_heartbeat", f"{where}: {first['msg']}") from None


# ----------------------------------------------------------------------------------------------
# the run's advertisement (what a producer needs to join; Redis hash ``run``, one string per field)


@dataclass
class RunInfo:
    """How to join a run, each field written by the service that knows it (docs/protocol.md 7.11).

    ingest_address: str, the broker's ZeroMQ address to connect a DEALER to (the broker, at start-up).
    reward_url:     str, the reward service's base URL (the first generator to start).
    sampling:       JSON object {n, temperature, top_p, top_k, max_tokens}: the sampling parameters
                    every producer of the run MUST use (the first generator to start).
    eos_token_id:   int, the EOS token id of the snapshots' tokenizer (the learner, at each publication).
    Absent fields are "" / {} / None: nobody has written them yet."""

    ingest_address: str = ""
    reward_url: str = ""
    sampling: dict[str, Any] = field(default_factory=dict)
    eos_token_id: int | None = None


def encode_run_fields(**values: Any) -> dict[str, str]:
    """The hash fields for the given RunInfo fields (only those, and only the known ones: each writer
    sets its own; a None value is left out)."""
    known = RunInfo.__dataclass_fields__
    unknown = set(values) - set(known)
    if unknown:
        raise ValueError(f"not RunInfo fields: {sorted(unknown)}")
    return {k: json.dumps(v, sort_keys=True) if k == "sampling" else str(v) for k, v in values.items()
            if v is not None}


def decode_run_info(fields: dict[bytes, bytes]) -> RunInfo:
    f = {k.decode(): v.decode() for k, v in fields.items()}
    try:
        return RunInfo(ingest_address=f.get("ingest_address", ""), reward_url=f.get("reward_url", ""),
                       sampling=json.loads(f["sampling"]) if "sampling" in f else {},
                       eos_token_id=int(f["eos_token_id"]) if "eos_token_id" in f else None)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise ProtocolError("bad_run_info", str(e)) from None


# ----------------------------------------------------------------------------------------------
# reward scoring (generator -> reward service, POST /score; JSON). The class names and fields are
# the reward service's pinned OpenAPI contract (tests/snapshots/reward_openapi.json, docs/rewards.md):
# a docstring here is part of that contract.


class ItemIn(BaseModel):
    """One completion to score."""

    prompt: str = Field("", description="the prompt text")
    completion: str = Field(description="the completion text, special tokens removed")
    reference: str = Field("", description="the reference answer, '' when there is none")
    finished: bool = Field(True, description="the completion ended with EOS (was not cut at max_tokens)")
    task: str = Field(description="the task; picks the plugin (see task_plugins, route_field)")
    metadata: dict[str, Any] = Field(default_factory=dict, description="dataset fields passed through (JSON)")
    num_tokens: int | None = Field(None, ge=0, description="completion length in tokens, when known")


class ScoreRequest(BaseModel):
    # the body of POST /score: items (a list of ItemIn, at most the service's max_batch)
    items: list[ItemIn]


class ResultOut(BaseModel):
    """score is null exactly when status is 'failed'; reason is then 'code: detail'."""

    score: float | None
    status: str = Field(description="'ok' or 'failed'")
    reason: str = ""
    plugin: str = Field("", description="the plugin that scored the item ('a+b' for a weighted route)")
    details: dict[str, float] = Field(default_factory=dict, description="named sub-scores")

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.score is not None

    @classmethod
    def failed(cls, reason: str, plugin: str) -> "ResultOut":
        return cls(score=None, status="failed", reason=reason, plugin=plugin)


class ScoreResponse(BaseModel):
    # the reply of POST /score: results (a list of ResultOut, one per item, in the items' order)
    results: list[ResultOut]
