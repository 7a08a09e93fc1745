"""The broker service: ZeroMQ ingest -> validation -> Redis trajectories stream, the prompt feeder,
and the HTTP server (the live dashboard and its API, ``/healthz``, ``/metrics``: broker/dashboard.py).

The broker never holds data only in memory: a group is acknowledged to its generator only after
it is in Redis. De-duplication (by group id), the queue bound and the append happen in one Lua
script, so a crash between them cannot leave a group half-recorded.

Ingest works in batches: the broker takes every message waiting on its socket (up to
``INGEST_BATCH`` messages or ``INGEST_BATCH_BYTES``), validates them, writes the whole batch to Redis
in one pipeline (the rejections' counters and dead letters, and one script call for the valid
groups), and only then sends the batch's acks. When Redis fails mid-batch no ack is sent at all:
the producers resend and the de-duplication answers what did get in.
"""

from __future__ import annotations

import logging
import threading
import time
from http.server import ThreadingHTTPServer

import redis
import zmq
from prometheus_client import CollectorRegistry, Counter
from pydantic import Field, model_validator

from broker import client, dashboard
from broker.config import StrictModel
from broker.keys import PROMPTS_GROUP, TRAJECTORIES_GROUP, Keys
from broker.protocol import Ack, ProtocolError, decode_group, encode_ack
from broker.datasets import DatasetConfig, DatasetSource, Position, load_tokenizer, read_rows
from broker.evals import EvalConfig, EvalScheduler, ensure_group as ensure_eval_group
from broker.tasks import TaskConfig, TaskSource

log = logging.getLogger("relay.broker")

# The valid groups of one ingest batch, in arrival order, in one atomic step.
# KEYS: seen set, trajectories stream, broker stats. ARGV[1]: max_queue_groups, ARGV[2]: the learner's
# consumer group, then 4 per group: group id, payload, min version, generator.
# Per group the reply is 'B' (busy: the unread groups are at the bound; nothing stored, nothing
# checked for duplicates), 'D' (duplicate: the id was appended before) or the new entry's id.
# Unread = XLEN - the learner's pending count, counted up as the batch appends: the bound is exact.
_APPEND_BATCH = """
local waiting = redis.call('XLEN', KEYS[2])
if waiting > 0 then
  local p = redis.pcall('XPENDING', KEYS[2], ARGV[2])
  if type(p) == 'table' and p.err == nil then waiting = waiting - tonumber(p[1]) end
end
local bound = tonumber(ARGV[1])
local out, n = {}, {ok = 0, dup = 0, busy = 0}
for i = 3, #ARGV, 4 do
  if waiting >= bound then
    out[#out + 1] = 'B'; n.busy = n.busy + 1
  elseif redis.call('SADD', KEYS[1], ARGV[i]) == 0 then
    out[#out + 1] = 'D'; n.dup = n.dup + 1
  else
    out[#out + 1] = redis.call('XADD', KEYS[2], '*', 'gid', ARGV[i], 'data', ARGV[i + 1], 'v', ARGV[i + 2],
                               'gen', ARGV[i + 3])
    waiting = waiting + 1; n.ok = n.ok + 1
  end
end
if n.ok > 0 then redis.call('HINCRBY', KEYS[3], 'accepted', n.ok) end
if n.dup > 0 then redis.call('HINCRBY', KEYS[3], 'duplicate', n.dup) end
if n.busy > 0 then redis.call('HINCRBY', KEYS[3], 'busy', n.busy) end
return out
"""

# at most this many messages, or this many bytes (at least one message), per ingest batch
INGEST_BATCH = 16
INGEST_BATCH_BYTES = 8 << 20
# the latest announced version is re-read at most this often (and always before a version_ahead rejection)
LATEST_TTL_S = 0.1
# the prompts stream is topped up at most this often
FEED_EVERY_S = 0.1


class BrokerConfig(StrictModel):
    """The broker: where it listens, how much it queues, which prompts it feeds."""

    run_id: str = Field("default", description="run id; namespaces every Redis key")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis server URL (redis:// or unix://)")
    ingest_bind: str = Field("tcp://127.0.0.1:5555", description="ZeroMQ ROUTER address generators send groups to")
    http_host: str = Field("127.0.0.1", description="host of the HTTP server (health, metrics, state)")
    http_port: int = Field(8080, ge=0, le=65535, description="port of the HTTP server; 0 picks a free one")
    dead_after_s: float = Field(10.0, gt=0, description="the dashboard shows a generator as dead when its last "
                                "heartbeat is older than this")
    dashboard_push_s: float = Field(1.0, gt=0, le=60, description="seconds between the dashboard's live updates")
    max_queue_groups: int = Field(256, ge=1, description="trajectories stream bound; above it producers get 'busy'")
    max_message_bytes: int = Field(16 << 20, ge=1024, description="largest accepted group message")
    dead_letter_max: int = Field(1000, ge=0, description="rejected messages kept for inspection")
    prompt_backlog: int = Field(64, ge=1, description="prompts kept ready in the prompts stream")
    task: TaskConfig = Field(default_factory=TaskConfig, description="the built-in task that feeds prompts "
                             "(when no dataset is given)")
    dataset: DatasetConfig | None = Field(None, description="a prompt dataset of your own (docs/datasets.md); "
                                          "null = the built-in task")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluation on a held-out set every N "
                             "versions (docs/eval.md)")

    @model_validator(mode="after")
    def _held_out_set(self) -> "BrokerConfig":
        if self.dataset is not None and self.eval.every_versions and self.eval.dataset is None \
                and not self.dataset.start:
            raise ValueError("eval: evaluation needs a held-out set: set eval.dataset, or dataset.start to leave the "
                             "first rows out of training, or eval.every_versions = 0")
        return self


class Broker:
    def __init__(self, cfg: BrokerConfig):
        self.cfg = cfg
        self.keys = Keys(cfg.run_id)
        self.r = client.connect_redis(cfg.redis_url)
        self._latest_version: int | None = None  # cached; see _version_ahead
        self._latest_read_at = float("-inf")
        self._next_feed = 0.0
        # the prompt source: the built-in task, or a dataset (its rows read now, so a bad path or
        # field mapping stops the broker at start; its tokenizer once the weights are announced)
        self.dataset_rows = read_rows(cfg.dataset) if cfg.dataset else None
        self.source = None if cfg.dataset else TaskSource(cfg.task)
        self.position = Position.from_fields(self.r.hgetall(self.keys.feeder))  # resume where the feeder was
        self.exhausted_logged = False
        self.evals = EvalScheduler(self.r, self.keys, cfg.eval, self._eval_source)
        self.stop_event = threading.Event()
        self.registry = CollectorRegistry()  # counters; gauges come from Redis at scrape time (dashboard.py)
        self.m_groups = Counter("relay_broker_groups", "groups received, by outcome", ["outcome", "reason"],
                                registry=self.registry)
        self.m_bytes = Counter("relay_broker_bytes", "bytes of accepted groups", registry=self.registry)
        self.m_prompts = Counter("relay_broker_prompts_fed", "prompts added to the prompts stream",
                                 registry=self.registry)
        self.dashboard = dashboard.Dashboard(self.r, self.keys, self.stop_event, cfg.dead_after_s,
                                             cfg.dashboard_push_s)
        self._ensure_groups()
        ensure_eval_group(self.r, self.keys)

    def _tokenizer(self, path: str):
        """The dataset's tokenizer: the configured folder, else the announced weights' (None until announced)."""
        if not path:
            latest = client.latest_announcement(self.r, self.keys)
            if latest is None:
                return None
            path = latest.path
        return load_tokenizer(path)

    def _eval_source(self):
        cfg = self.cfg
        if cfg.eval.dataset is not None or cfg.dataset is not None:
            ds = cfg.eval.dataset or cfg.dataset.model_copy(update={"start": 0, "stop": cfg.dataset.start or None,
                                                                    "epochs": None})
            if cfg.eval.dataset is None and not cfg.dataset.start:
                raise ValueError("evaluation needs a held-out set: set broker.eval.dataset, or broker.dataset.start "
                                 "to leave the first rows out of training, or broker.eval.every_versions = 0")
            tok = self._tokenizer(ds.tokenizer or (cfg.dataset.tokenizer if cfg.dataset else ""))
            return None if tok is None else DatasetSource(ds, tok)
        return TaskSource(cfg.task.model_copy(update={"seed": cfg.eval.seed}))

    def _ensure_groups(self) -> None:
        for stream, group in ((self.keys.prompts, PROMPTS_GROUP), (self.keys.trajectories, "learner")):
            try:
                self.r.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    # -- ingest ---------------------------------------------------------------------------------

    def _count(self, outcome: str, reason: str = "") -> None:
        self.m_groups.labels(outcome, reason).inc()
        pipe = self.r.pipeline()
        pipe.hincrby(self.keys.stats("broker"), f"{outcome}:{reason}" if reason else outcome, 1)
        if outcome == "rejected":
            pipe.hincrby(self.keys.stats("broker"), "rejected_total", 1)
        pipe.execute()

    def _read_latest(self) -> int | None:
        latest = client.latest_announcement(self.r, self.keys)
        self._latest_version = None if latest is None else latest.version
        self._latest_read_at = time.monotonic()
        return self._latest_version

    def _version_ahead(self, newest: int) -> int | None:
        """The latest announced version when ``newest`` is ahead of it, else None. The version is
        cached for ``LATEST_TTL_S``; a message ahead of the cached one makes a fresh read first, so
        a new announcement never causes a false rejection."""
        if time.monotonic() - self._latest_read_at > LATEST_TTL_S:
            self._read_latest()
        if self._latest_version is None or newest <= self._latest_version:
            return None
        latest = self._read_latest()
        return latest if latest is not None and newest > latest else None

    def handle_batch(self, payloads: list[bytes]) -> list[Ack]:
        """Validate a batch of messages and write it to Redis in one pipeline; one Ack per message, in
        order. Never raises for bad input; raises redis errors (then nothing may be acknowledged)."""
        acks: list[Ack | None] = [None] * len(payloads)
        valid = []  # (index, group, payload)
        pipe = self.r.pipeline(transaction=False)
        rejected = []
        for i, payload in enumerate(payloads):
            try:
                g = decode_group(payload, self.cfg.max_message_bytes)
                if g.run_id != self.cfg.run_id:
                    raise ProtocolError("wrong_run", f"run_id {g.run_id!r} is not this run ({self.cfg.run_id!r})")
                newest = max((v for s in g.samples for v, _ in s.version_runs), default=0)
                latest = self._version_ahead(newest)
                if latest is not None:
                    raise ProtocolError("version_ahead", f"token version {newest} > latest published {latest}")
            except ProtocolError as e:
                rejected.append(e.reason)
                pipe.hincrby(self.keys.stats("broker"), f"rejected:{e.reason}", 1)
                pipe.hincrby(self.keys.stats("broker"), "rejected_total", 1)
                if self.cfg.dead_letter_max:
                    pipe.xadd(self.keys.dead_letter, {"reason": e.reason, "detail": e.detail[:500],
                                                      "data": payload[:65536]},
                              maxlen=self.cfg.dead_letter_max, approximate=True)
                log.warning("rejected a message: %s", e)
                acks[i] = Ack(group_id=_peek_group_id(payload), status="rejected", reason=e.reason)
                continue
            valid.append((i, g, payload))
        if valid:
            args: list = [self.cfg.max_queue_groups, TRAJECTORIES_GROUP]
            for _, g, payload in valid:
                args += [g.group_id, payload, g.min_version, g.generator_id]
            # EVAL, not EVALSHA: a pipeline's registered script costs a SCRIPT EXISTS round trip per
            # execute, and Redis caches the compiled body anyway
            pipe.eval(_APPEND_BATCH, 3, self.keys.seen, self.keys.trajectories, self.keys.stats("broker"), *args)
        results = pipe.execute() if len(pipe) else []
        for reason in rejected:
            self.m_groups.labels("rejected", reason).inc()
        for (i, g, payload), res in zip(valid, results[-1] if valid else []):
            if res == b"B":
                self.m_groups.labels("busy", "").inc()
                acks[i] = Ack(g.group_id, "busy")
            elif res == b"D":
                self.m_groups.labels("duplicate", "").inc()
                acks[i] = Ack(g.group_id, "duplicate")
            else:
                self.m_groups.labels("accepted", "").inc()
                self.m_bytes.inc(len(payload))
                acks[i] = Ack(g.group_id, "ok", stream_id=res.decode())
        return acks

    def handle(self, payload: bytes) -> Ack:
        """Validate one message and append it (a batch of one)."""
        return self.handle_batch([payload])[0]

    def feed_prompts(self) -> None:
        """Top the prompts stream up to ``prompt_backlog`` entries (generators delete what they finish),
        at most every ``FEED_EVERY_S``.

        The prompts and the feeder's new position go to Redis in one MULTI/EXEC: a broker killed at
        any moment resumes after the last prompt it added, never skipping or repeating one."""
        now = time.monotonic()
        if now < self._next_feed:
            return
        self._next_feed = now + FEED_EVERY_S
        missing = self.cfg.prompt_backlog - self.r.xlen(self.keys.prompts)
        if missing <= 0:
            return
        if self.source is None:
            tok = self._tokenizer(self.cfg.dataset.tokenizer)
            if tok is None:
                return  # the learner has not announced the weights (and their tokenizer) yet
            self.source = DatasetSource(self.cfg.dataset, tok, rows=self.dataset_rows)
        if self.source.exhausted(self.position):
            if not self.exhausted_logged:
                log.info("the dataset is exhausted after %d epoch(s): %d prompts fed, %d skipped as too long",
                         self.position.epoch, self.position.fed, self.position.skipped)
                self.exhausted_logged = True
            return
        got, pos = self.source.take(missing, self.position)
        pipe = self.r.pipeline(transaction=True)
        for n, (epoch, row, rec) in enumerate(got, self.position.fed + 1):
            pipe.xadd(self.keys.prompts, {**rec.fields(), "seq": n, "epoch": epoch, "row": row})
        pipe.hset(self.keys.feeder, mapping=pos.as_fields())
        pipe.hset(self.keys.stats("broker"), mapping={"prompts_fed": pos.fed, "prompts_skipped_too_long": pos.skipped,
                                                      "epoch": pos.epoch})
        pipe.execute()
        if pos.skipped > self.position.skipped:
            log.warning("skipped %d prompt(s) longer than max_prompt_tokens (%d so far)",
                        pos.skipped - self.position.skipped, pos.skipped)
        self.position = pos
        self.m_prompts.inc(len(got))

    def run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.cfg.ingest_bind)
        except zmq.ZMQError as e:
            raise OSError(f"cannot bind ingest address {self.cfg.ingest_bind}: {e} (is the port in use?)") from None
        log.info("ingest listening on %s", self.cfg.ingest_bind)
        while not self.stop_event.is_set():
            try:
                self.feed_prompts()
                self.evals.tick()
                if not sock.poll(100):
                    continue
                batch = self._drain(sock)
                acks = self.handle_batch([payload for _, payload in batch if payload is not None])
                replies, it = [], iter(acks)
                for ident, payload in batch:
                    replies.append((ident, next(it) if payload is not None else Ack("", "rejected", "bad_framing")))
                for ident, ack in replies:
                    sock.send_multipart([ident, b"", encode_ack(ack)])
            except (redis.ConnectionError, redis.TimeoutError) as e:
                # No ack is sent: the generator keeps the group and resends once Redis is back.
                log.warning("redis unavailable (%s); retrying", e)
                time.sleep(0.5)
        sock.close(linger=0)

    def _drain(self, sock: zmq.Socket) -> list[tuple[bytes, bytes | None]]:
        """Every message waiting on the socket, up to the batch limits: (identity, payload), payload
        None for a badly framed one (counted here, answered 'rejected' with an empty group id, never
        appended)."""
        batch, nbytes = [], 0
        while len(batch) < INGEST_BATCH and nbytes < INGEST_BATCH_BYTES:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or frames[1] != b"":
                self._count("rejected", "bad_framing")
                batch.append((frames[0], None))
                continue
            batch.append((frames[0], frames[2]))
            nbytes += len(frames[2])
        return batch

    def serve_http(self) -> ThreadingHTTPServer:
        """The dashboard, its API, /metrics and /healthz on ``http_host:http_port`` (a thread)."""
        return dashboard.serve(self.cfg.http_host, self.cfg.http_port, self.dashboard, self.registry)


def _peek_group_id(payload: bytes) -> str:
    """Best-effort group id of an invalid message, for the ack (empty when unreadable)."""
    import msgpack

    try:
        m = msgpack.unpackb(payload, raw=False)
        gid = m.get("group_id", "") if isinstance(m, dict) else ""
        return gid if isinstance(gid, str) else ""
    except Exception:  # garbage is expected here; the message was already rejected and counted
        return ""
