"""The broker's ingest: groups arrive on a ZeroMQ ROUTER socket, are validated (broker/protocol/group.py)
and appended to the trajectories stream in Redis; each producer gets an ack per group.

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
import time

import msgpack
import redis
import zmq
from prometheus_client import CollectorRegistry, Counter

from broker.client import queues
from broker.client.announcements import latest_announcement
from broker.config import BrokerConfig
from broker.protocol.codec import ProtocolError
from broker.protocol.group import decode_group
from broker.protocol.keys import Keys
from broker.protocol.messages import Ack, encode_ack

log = logging.getLogger("relay.broker.ingest")

# at most this many messages, or this many bytes (at least one message), per ingest batch
INGEST_BATCH = 16
INGEST_BATCH_BYTES = 8 << 20
# the latest announced version is re-read at most this often (and always before a version_ahead rejection)
LATEST_TTL_S = 0.1


class Ingest:
    """Validates and appends groups; counts every outcome (Redis ``stats:broker`` and Prometheus)."""

    def __init__(self, r: redis.Redis, keys: Keys, cfg: BrokerConfig, registry: CollectorRegistry,
                 announce_key: bytes | None = None):
        self.r, self.keys, self.cfg = r, keys, cfg
        self.announce_key = announce_key  # a forged announcement's version never drives version_ahead
        self._latest_version: int | None = None  # cached; see _version_ahead
        self._latest_read_at = float("-inf")
        self.m_groups = Counter("relay_broker_groups", "groups received, by outcome", ["outcome", "reason"],
                                registry=registry)
        self.m_bytes = Counter("relay_broker_bytes", "bytes of accepted groups", registry=registry)

    def bind(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.cfg.ingest_bind)
        except zmq.ZMQError as e:
            raise OSError(f"cannot bind ingest address {self.cfg.ingest_bind}: {e} (is the port in use?)") from None
        log.info("ingest listening on %s", self.cfg.ingest_bind)
        return sock

    def _count(self, outcome: str, reason: str = "") -> None:
        self.m_groups.labels(outcome, reason).inc()
        pipe = self.r.pipeline()
        pipe.hincrby(self.keys.stats("broker"), f"{outcome}:{reason}" if reason else outcome, 1)
        if outcome == "rejected":
            pipe.hincrby(self.keys.stats("broker"), "rejected_total", 1)
        pipe.execute()

    def _read_latest(self) -> int | None:
        latest = latest_announcement(self.r, self.keys, self.announce_key)
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
                    queues.dead_letter(pipe, self.keys, e.reason, e.detail, payload, self.cfg.dead_letter_max)
                log.warning("rejected a message: %s", e)
                acks[i] = Ack(group_id=_peek_group_id(payload), status="rejected", reason=e.reason)
                continue
            valid.append((i, g, payload))
        if valid:
            queues.append_groups(pipe, self.keys, self.cfg.max_queue_groups, [(g, payload) for _, g, payload in valid])
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

    def serve_waiting(self, sock: zmq.Socket) -> None:
        """Handle every message waiting on ``sock`` (one batch) and send their acks."""
        batch = self._drain(sock)
        acks = iter(self.handle_batch([payload for _, payload in batch if payload is not None]))
        replies = [(ident, next(acks) if payload is not None else Ack("", "rejected", "bad_framing"))
                   for ident, payload in batch]
        for ident, ack in replies:
            sock.send_multipart([ident, b"", encode_ack(ack)])

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


def _peek_group_id(payload: bytes) -> str:
    """Best-effort group id of an invalid message, for the ack (empty when unreadable)."""
    try:
        m = msgpack.unpackb(payload, raw=False)
        gid = m.get("group_id", "") if isinstance(m, dict) else ""
        return gid if isinstance(gid, str) else ""
    except Exception:  # garbage is expected here; the message was already rejected and counted
        return ""
