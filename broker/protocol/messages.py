"""Every message between services except the group (group.py), each defined once, here:

    Ack           broker -> generator       msgpack map, ``kind`` "ack"       (ZeroMQ reply to a group)
    Announcement  learner -> generators     msgpack map, ``kind`` "announce"  (Redis key + pub/sub)
    PromptEntry   broker -> generators      Redis stream fields (strings)     (streams ``prompts``, ``eval_prompts``)
    EvalRound     broker -> whoever sums up JSON object                       (hash ``eval_rounds``)
    EvalResult    generator -> broker       JSON object                       (stream ``eval_results``, field ``data``)
    Heartbeat     generator -> everyone     JSON object                       (Redis hash ``generators``)
    ServiceEndpoint  any service -> the dashboard  JSON object                (Redis hash ``services``)
    Event         any service -> dashboards stream fields kind, t, data (JSON) (Redis stream ``events``)
    RunInfo       broker, generators, learner -> producers  Redis hash fields (``run``: how to join a run)
    ItemIn, ScoreRequest, ResultOut, ScoreResponse  generator <-> reward service  JSON over HTTP (POST /score)

Control messages (ack, announce) carry a ``kind`` tag; the others are stream entries, state (a
heartbeat, the run's advertisement) or the body of one HTTP route, so their place says what they are. docs/protocol.md
specifies the bytes; tests/snapshots/reward_openapi.json pins the reward service's JSON.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
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
        {
            "schema": SCHEMA_VERSION,
            "kind": "ack",
            "group_id": a.group_id,
            "status": a.status,
            "reason": a.reason,
            "stream_id": a.stream_id,
        },
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
    digest:  the digest of the tensors themselves (broker/protocol/tensordigest.py: ``xxh3:<hex>`` or, with
             weights.digest = sha256, plain hex), the same however they
             travel (store, http, collective): each generator compares it with the digest of what it
             applied. "" from a learner before digests existed.
    sig:     hex Ed25519 signature of every other field by the learner's private key (signing.py), or ""
             when the run's announcements are not signed (``announce_auth = "insecure"``).
    base:    LoRA adapter versions (learner.lora, docs/weights.md "LoRA adapters"): the version whose
             folder holds the base model the adapter applies to; ``base == version`` for a version that
             carries the base itself, ``base < version`` for one holding only the adapter. None
             without LoRA adapters (every version is a whole model).
    base_digest: with ``base``: the tensor digest of the base model's weights alone (the pin: a
             generator serving another base refuses the adapter).
    """

    version: int
    hash: str
    path: str
    url: str = ""
    published_at: float = field(default_factory=time.time)
    sig: str = ""
    digest: str = ""
    base: int | None = None
    base_digest: str = ""

    @property
    def adapter_only(self) -> bool:
        """A LoRA version holding only the adapter: the base comes from version ``base``."""
        return self.base is not None and self.base != self.version


def encode_announcement(a: Announcement) -> bytes:
    m = {
        "schema": SCHEMA_VERSION,
        "kind": "announce",
        "version": a.version,
        "hash": a.hash,
        "path": a.path,
        "url": a.url,
        "published_at": a.published_at,
    }
    if a.digest:
        m["digest"] = a.digest
    if a.base is not None:
        m["base"], m["base_digest"] = a.base, a.base_digest
    if a.sig:
        m["sig"] = a.sig
    return msgpack.packb(m, use_bin_type=True)


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
        sig=str(m.get("sig", "")),
        digest=str(m.get("digest", "")),
        base=get_field(m, "base", int, "announce") if "base" in m else None,
        base_digest=str(m.get("base_digest", "")),
    )


# ----------------------------------------------------------------------------------------------
# prompt entries (broker -> generators; the prompts and eval_prompts streams, every field a string)


@dataclass
class PromptEntry:
    """One prompt to sample (docs/protocol.md 7.1). Training prompts carry ``seq``/``epoch``/``row``;
    held-out prompts of an evaluation round carry ``round`` ... ``max_tokens`` (docs/eval.md)."""

    text: str  # the prompt text (tokenized with the snapshot's tokenizer)
    reference: str = ""  # the reference answer, for the reward
    task: str = ""  # the task: picks the reward plugin
    prompt_ids: list[int] | None = None  # JSON list of token ids to feed exactly (dataset prompts, template applied)
    metadata: dict[str, Any] = field(default_factory=dict)  # JSON object: dataset fields for the reward
    # JSON list of chat messages [{role, content}, ...] that prompt_ids render through the chat template
    # (dataset prompts with chat_template): a multi-turn episode continues this conversation (docs/agents.md)
    messages: list[dict] | None = None
    seq: int | None = None  # training: the broker's sequence number (1, 2, ...)
    epoch: int | None = None  # training: which pass over the source
    row: int | None = None  # training: which row (or built-in prompt number) of the source
    round: int | None = None  # evaluation: the round (the weight version it evaluates)
    idx: int | None = None  # evaluation: the prompt's index in the round
    greedy: bool = False  # evaluation: one greedy completion ("1" / "0")
    samples: int = 0  # evaluation: completions sampled at the training temperature
    max_tokens: int = 0  # evaluation: most new tokens (0: the generator's own)

    _INTS = ("seq", "epoch", "row", "round", "idx")

    def fields(self) -> dict[str, str]:
        """The stream entry's fields (absent optional fields are left out)."""
        out = {"text": self.text, "reference": self.reference, "task": self.task}
        if self.prompt_ids is not None:
            out["prompt_ids"] = json.dumps(self.prompt_ids, separators=(",", ":"))
        if self.metadata:
            out["metadata"] = json.dumps(self.metadata, default=str)
        if self.messages is not None:
            out["messages"] = json.dumps(self.messages, separators=(",", ":"))
        out.update({k: str(getattr(self, k)) for k in self._INTS if getattr(self, k) is not None})
        if self.round is not None:
            out.update(greedy=str(int(self.greedy)), samples=str(self.samples), max_tokens=str(self.max_tokens))
        return out

    @classmethod
    def from_fields(cls, f: dict[str, str]) -> "PromptEntry":
        """An entry read from the stream, or ProtocolError ``bad_prompt`` naming the field."""
        try:
            ids = json.loads(f["prompt_ids"]) if f.get("prompt_ids") else None
            if ids is not None and (
                not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids)
            ):
                raise ValueError(f"prompt_ids must be a non-empty JSON list of token ids, got {f['prompt_ids'][:80]!r}")
            msgs = json.loads(f["messages"]) if f.get("messages") else None
            if msgs is not None and (
                not isinstance(msgs, list)
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs)
            ):
                raise ValueError(
                    f"messages must be a JSON list of {{role, content}} objects, got {f['messages'][:80]!r}"
                )
            return cls(
                text=f.get("text", ""),
                reference=f.get("reference", ""),
                task=f.get("task", ""),
                prompt_ids=ids,
                metadata=json.loads(f.get("metadata") or "{}"),
                messages=msgs,
                **{k: int(f[k]) for k in cls._INTS if f.get(k)},
                greedy=f.get("greedy") == "1",
                samples=int(f.get("samples") or 0),
                max_tokens=int(f.get("max_tokens") or 0),
            )
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError("bad_prompt", str(e)) from None


# ----------------------------------------------------------------------------------------------
# evaluation results (generator -> the broker's aggregation, broker/prompts/evals.py; JSON)


class JsonRecord:
    """A dataclass that travels as one JSON object: an absent field takes its default (a required
    one missing is an error), unknown keys are ignored; ``bad`` is the ProtocolError reason."""

    bad = "bad_record"

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, data: bytes | str):
        try:
            m = json.loads(data)
            return cls(**{k: m[k] for k in cls.__dataclass_fields__ if k in m})
        except (ValueError, TypeError) as e:  # not JSON, not an object, a required field missing
            raise ProtocolError(cls.bad, f"{type(e).__name__}: {e}") from None


@dataclass
class EvalRound(JsonRecord):
    """One evaluation round as the broker enqueued it: JSON in the hash ``eval_rounds`` under its
    version (docs/eval.md)."""

    version: int  # the weight version the round evaluates
    prompts: int  # held-out prompts in the round
    greedy: bool = True  # one greedy completion per prompt
    samples: int = 0  # completions per prompt at the training temperature (pass@k)
    threshold: float = 1.0  # a reward at or above it is a correct answer
    final: bool = False  # the round after the learner finished
    enqueued_at: float = 0.0  # unix time

    bad = "bad_eval_round"


@dataclass
class EvalCompletion:
    """One evaluated completion."""

    reward: float | None  # the reward; None when it failed
    status: str = "ok"  # "ok" | "failed"
    length: int = 0  # completion tokens
    finish_reason: str = ""  # "stop" | "length"

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.reward is not None


@dataclass
class EvalResult:
    """One evaluated prompt: the ``data`` of an ``eval_results`` entry (its ``round`` and ``idx`` are
    the entry's other fields). ``greedy`` and/or ``samples``, as the round asked."""

    version: int | None = None  # the weight version that generated it
    generator: str = ""  # the generator id
    greedy: EvalCompletion | None = None  # the greedy completion (top_k = 1)
    samples: list[EvalCompletion] = field(default_factory=list)  # completions at the training temperature


def encode_eval_result(res: EvalResult) -> str:
    out: dict[str, Any] = {"version": res.version, "generator": res.generator}
    if res.greedy is not None:
        out["greedy"] = asdict(res.greedy)
    if res.samples:
        out["samples"] = [asdict(c) for c in res.samples]
    return json.dumps(out)


def decode_eval_result(data: bytes | str) -> EvalResult:
    """An evaluation result, or ProtocolError ``bad_eval_result``."""
    try:
        m = json.loads(data)
        greedy = EvalCompletion(**m["greedy"]) if m.get("greedy") else None
        return EvalResult(
            version=m.get("version"),
            generator=m.get("generator", ""),
            greedy=greedy,
            samples=[EvalCompletion(**c) for c in m.get("samples") or []],
        )
    except (ValueError, TypeError, AttributeError) as e:
        raise ProtocolError("bad_eval_result", str(e)) from None


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
    version: int | None = Field(
        None,
        description="int or null: the weight version served (null before the first "
        "load); keeps that snapshot from being pruned while the heartbeat is recent",
    )
    hash: str = Field("", description="str: the manifest hash of the version served")
    last_seen: float | None = Field(
        None, description="float: unix time of this heartbeat (null/absent: shown dead, pins nothing)"
    )
    state: str = Field(
        "unknown",
        description="str: starting, waiting_for_weights, updating, sampling, "
        "waiting_for_prompts, sending, paused_staleness, paused_backpressure, paused_reward, draining, "
        "stopped",
    )
    backend: str = Field("", description="str: the inference backend (torch, vllm, sglang, simulated)")
    sink_state: str = Field(
        "",
        description="str: what the thread that scores and sends is doing: idle, scoring, "
        "sending, paused_backpressure, paused_reward",
    )
    in_flight: str = Field("", description="str: the in-flight policy, finish or continue")
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="object: the inference engine's identity "
        "(pid, ...); the same across updates = weights applied in place",
    )
    tokens_per_s: float = Field(0.0, description="float: completion tokens per second of the last batch")
    refused: dict[str, str] = Field(
        default_factory=dict, description="object: manifest hash -> reason, the last 3 versions refused"
    )
    metrics_port: int | None = Field(None, description="int: the port of its /metrics")
    groups_sent: int = Field(0, description="int: groups acknowledged ok or duplicate")
    groups_rejected: int = Field(0, description="int: groups the broker rejected")
    tokens: int = Field(0, description="int: completion tokens sampled")
    updates: int = Field(0, description="int: weight versions applied")
    refused_updates: int = Field(0, description="int: weight versions refused (failed verification)")
    forged_announcements: int = Field(
        0, description="int: announcements ignored because their signature is missing or wrong (not the learner's)"
    )
    reward_failures: int = Field(0, description="int: samples whose reward failed")
    reward_failures_by_plugin: dict[str, int] = Field(
        default_factory=dict, description="object: plugin -> samples whose reward failed"
    )
    reward_ok: int = Field(0, description="int: samples whose reward was scored")
    reward_last_failure: dict[str, str] = Field(
        default_factory=dict,
        description="object: plugin -> the reason of its latest failed sample (at most 200 characters)",
    )
    reward_pauses: int = Field(0, description="int: reward outages that held a batch (state paused_reward)")
    reward_paused_s: float = Field(0.0, description="float: seconds batches were held through reward outages")
    last_update_latency_s: float | None = Field(None, description="float: publish -> apply seconds of the last update")
    episodes: dict[str, Any] = Field(
        default_factory=dict,
        description="object: multi-turn episodes (docs/agents.md), "
        "empty for single-turn tasks: episodes, turns (totals), tool_calls and "
        "tool_failures (objects: tool -> count), env_failures (object: reason -> count), "
        "env_seconds (total), template_drift (count), unspellable_replies (count: "
        "environment replies the tokenizer cannot spell)",
    )


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
# where each service's /metrics is, and the events stream (service -> dashboards)


@dataclass
class ServiceEndpoint(JsonRecord):
    """Where one service's ``/metrics`` listens: JSON in the hash ``services`` under
    ``"<service>:<replica>"`` (the broker's Prometheus service discovery reads it)."""

    service: str  # broker, generator, learner, ...
    replica: str  # its replica id ("0", a generator id)
    host: str  # the host to scrape
    port: int  # the port of its /metrics
    started_at: float = 0.0  # unix time of the registration

    bad = "bad_service"

    @classmethod
    def decode(cls, data: bytes | str) -> "ServiceEndpoint":
        ep = super().decode(data)
        if not all(isinstance(x, str) for x in (ep.service, ep.replica, ep.host)) or type(ep.port) is not int:
            raise ProtocolError(cls.bad, f"wrong types in {asdict(ep)!r:.200}")
        return ep


@dataclass
class Event:
    """One entry of the capped ``events`` stream: what happened to weights (and evaluation rounds),
    for dashboards (docs/protocol.md 7.7)."""

    kind: str  # published | applied | refused | eval_round
    t: float  # unix time
    data: dict[str, Any]  # per kind: version, hash, generator, latency_s, reason, prompts, final

    def fields(self) -> dict[str, str]:
        return {"kind": self.kind, "t": repr(self.t), "data": json.dumps(self.data)}

    @classmethod
    def from_fields(cls, f: dict[str, str]) -> "Event":
        """An entry as read; unreadable ``data`` becomes ``{"error": "unreadable entry"}``."""
        try:
            data = json.loads(f.get("data", "{}"))
        except json.JSONDecodeError:
            data = {"error": "unreadable entry"}
        return cls(kind=f.get("kind", "?"), t=float(f.get("t", 0) or 0), data=data)


# ----------------------------------------------------------------------------------------------
# the run's advertisement (what a producer needs to join; Redis hash ``run``, one string per field)


@dataclass
class RunInfo:
    """How to join a run, each field written by the service that knows it (docs/protocol.md 7.11).

    ingest_address: str, the broker's ZeroMQ address to connect a DEALER to (the broker, at start-up).
    ingest_addresses: str, every ingest worker's address, comma-separated (the first is ingest_address);
                    a producer that connects its DEALER to all of them spreads its groups over the workers
                    (docs/protocol.md 5.1); absent from runs of one worker's brokers before it existed.
    ingest_auth:    str, "curve" (a producer needs a listed CURVE key, docs/protocol.md 5.4) or
                    "insecure" (plain ZMTP) (the broker, at start-up).
    reward_url:     str, the reward service's base URL (the first generator to start).
    sampling:       JSON object {n, temperature, top_p, top_k, max_tokens}: the sampling parameters
                    every producer of the run MUST use (the first generator to start).
    eos_token_id:   int, the EOS token id of the snapshots' tokenizer (the learner, at each publication).
    Absent fields are "" / {} / None: nobody has written them yet."""

    ingest_address: str = ""
    ingest_addresses: str = ""
    ingest_auth: str = ""
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
    return {k: json.dumps(v, sort_keys=True) if k == "sampling" else str(v) for k, v in values.items() if v is not None}


def decode_run_info(fields: dict[bytes, bytes]) -> RunInfo:
    f = {k.decode(): v.decode() for k, v in fields.items()}
    try:
        return RunInfo(
            ingest_address=f.get("ingest_address", ""),
            ingest_auth=f.get("ingest_auth", ""),
            ingest_addresses=f.get("ingest_addresses", f.get("ingest_address", "")),
            reward_url=f.get("reward_url", ""),
            sampling=json.loads(f["sampling"]) if "sampling" in f else {},
            eos_token_id=int(f["eos_token_id"]) if "eos_token_id" in f else None,
        )
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
