"""The broker's ingest: groups arrive on a ZeroMQ ROUTER socket, are validated (broker/protocol/group.py)
and appended to the trajectories stream in Redis; each producer gets an ack per group.

The broker never holds data only in memory: a group is acknowledged to its generator only after
it is in Redis. De-duplication (by group id), the queue bound and the append happen in one Lua
script, in one MULTI with the messages it appends (each written under a key of its own, which the
script names after its stream entry: docs/protocol.md 7.3), so a crash between them cannot leave a
group half-recorded.

Ingest works in batches: the broker takes every message waiting on its socket (up to
``INGEST_BATCH`` messages or ``INGEST_BATCH_BYTES``), validates them, writes the whole batch to Redis
in one pipeline (the rejections' counters and dead letters, and one script call for the valid
groups), and only then sends the batch's acks. The loop is pipelined (:meth:`Ingest.serve`): while
one batch's pipeline runs in Redis, the next batch is drained and validated. When Redis fails
mid-batch no ack is sent at all, for that batch nor the one validated meanwhile: the producers
resend and the de-duplication answers what did get in.

Who may send (docs/security.md "Ingest"): with ``ingest_auth = "curve"`` the socket is a CURVE server
and a ZAP handler admits only the public keys of the allow-list; a producer with any other key never
completes the handshake, so nothing it sends is read. Each message carries the key it came with
(ZeroMQ's ``User-Id``), and a group whose ``generator_id`` is not one that key may use is rejected
``wrong_generator``. A message larger than ``max_message_bytes`` is answered ``too_large`` without being
decoded, up to a margin (:func:`socket_max_frame`); a larger frame closes the connection
(``ZMQ_MAXMSGSIZE``, which under CURVE counts the encrypted frame: the overhead is added). Every message
is decoded once, within msgpack's per-object limits.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import redis
import zmq
from prometheus_client import CollectorRegistry, Counter
from zmq.auth.thread import ThreadAuthenticator

from broker.client import queues
from broker.client.announcements import announced_hashes, latest_announcement
from broker.client.overlap import OverlappedTransactions
from broker.config import BrokerConfig
from broker.protocol.codec import ProtocolError
from broker.protocol.group import (
    Group,
    GroupHead,
    decode_group_fast,
    group_from_map,
    group_id_in_head,
    group_id_of,
    unpack_group,
)
from broker.protocol.ingest_auth import AllowList, load_allow_list, load_server_keys
from broker.protocol.keys import Keys
from broker.protocol.messages import Ack, encode_ack
from broker.runtime.ratelog import RateLimitedLog
from broker.runtime.ports import handed_over_bind
from broker.protocol.signing import AnnounceVerifier

log = logging.getLogger("relay.broker.ingest")

# at most this many messages, or this many bytes (at least one message), per ingest batch
INGEST_BATCH = 16
INGEST_BATCH_BYTES = 8 << 20
# the latest announced version is re-read at most this often (and always before a version_ahead rejection)
LATEST_TTL_S = 0.1
# refused handshakes logged one by one: at most this many per interval, then one summary line per interval
DENIED_LOG_BURST, DENIED_LOG_INTERVAL_S = 5, 10.0
# what CURVE adds to each frame on the wire, which ZMQ_MAXMSGSIZE counts: the MESSAGE command's name
# ("\x07MESSAGE", 8 bytes), its nonce (8), the flags byte and the box's MAC (16) (ZeroMQ RFC 26)
CURVE_FRAME_OVERHEAD = 33


def too_large_margin(max_message_bytes: int) -> int:
    """Bytes past ``max_message_bytes`` that the ingest still takes in to answer ``too_large``: a
    sixteenth of the limit, at least 64 KiB (1 MiB for the default 16 MiB)."""
    return max(64 << 10, max_message_bytes // 16)


def socket_max_frame(max_message_bytes: int, curve: bool) -> int:
    """The ingest socket's ``ZMQ_MAXMSGSIZE``: a message of up to ``max_message_bytes`` is decoded, one of up
    to ``too_large_margin`` more is answered ``too_large`` (not decoded), a longer frame closes the
    producer's connection unanswered (ZeroMQ drops it before it is held). Under CURVE ZeroMQ compares
    the encrypted frame, ``CURVE_FRAME_OVERHEAD`` bytes longer than the message."""
    return max_message_bytes + too_large_margin(max_message_bytes) + (CURVE_FRAME_OVERHEAD if curve else 0)


@dataclass
class _Batch:
    """A validated batch: its pipeline (not yet sent), an ack per message (filled for the rejected ones
    now, for the valid ones from the pipeline's results), the valid groups and the rejection reasons."""

    pipe: redis.client.Pipeline
    acks: list[Ack | None]
    valid: list[tuple[int, Group | GroupHead, bytes | memoryview]] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


class Ingest:
    """Validates and appends groups; counts every outcome (Redis ``stats:broker`` and Prometheus)."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        cfg: BrokerConfig,
        registry: CollectorRegistry,
        announce_key: AnnounceVerifier | None = None,
    ):
        self.r, self.keys, self.cfg = r, keys, cfg
        self.announce_key = announce_key  # a forged announcement's version never drives version_ahead
        self._latest_version: int | None = None  # cached; see _version_ahead
        self._latest_read_at = float("-inf")
        self._hashes: dict[int, str] = {}  # announced hash per version, cached; see _check_hash
        # CURVE: the keys and the allow-list are read now, so a missing file fails at start-up
        self.allowed: AllowList | None = None
        if cfg.ingest_auth == "curve":
            self._server_keys = load_server_keys(cfg.ingest_key_file)
            self.allowed = load_allow_list(cfg.ingest_clients_file)
        self._auth: ThreadAuthenticator | None = None
        # the pipelined loop (serve): one batch's transaction runs in Redis while the next is validated
        self._writer = OverlappedTransactions(r)
        self._inflight: tuple[list, _Batch] | None = None
        self.m_groups = Counter(
            "relay_broker_groups", "groups received, by outcome", ["outcome", "reason"], registry=registry
        )
        self.m_bytes = Counter("relay_broker_bytes", "bytes of accepted groups", registry=registry)
        self.m_denied = Counter(
            "relay_broker_ingest_denied", "CURVE handshakes refused: key not in the allow-list", registry=registry
        )
        # anyone who knows the broker's public key can make it refuse handshakes at will: a few lines in full
        # per interval, then one summary line (the counter above counts every refusal)
        self._denied_log = RateLimitedLog(
            log,
            "CURVE handshakes refused (keys not in the allow-list)",
            interval_s=DENIED_LOG_INTERVAL_S,
            burst=DENIED_LOG_BURST,
        )

    def bind(self) -> zmq.Socket:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # past max_message_bytes: answered too_large up to a margin; a larger frame closes the connection
        sock.setsockopt(zmq.MAXMSGSIZE, socket_max_frame(self.cfg.max_message_bytes, self.allowed is not None))
        if self.allowed is not None:
            self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("relay.broker.zap"))
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=self)
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = self._server_keys
        else:
            log.warning("ingest_auth = insecure: any process that reaches %s can send groups", self.cfg.ingest_bind)
        fd = handed_over_bind(self.cfg.ingest_bind)
        if fd is not None:  # the socket relay up bound for this address and handed over (broker/runtime/ports.py)
            sock.setsockopt(zmq.USE_FD, os.dup(fd))  # ZeroMQ closes what it is given when the socket closes
        try:
            sock.bind(self.cfg.ingest_bind)
        except zmq.ZMQError as e:
            raise OSError(f"cannot bind ingest address {self.cfg.ingest_bind}: {e} (is the port in use?)") from None
        log.info("ingest listening on %s (%s)", self.cfg.ingest_bind, self.cfg.ingest_auth)
        return sock

    def close(self, sock: zmq.Socket) -> None:
        if self._inflight is not None:  # the last batch's acks, when its transaction went through
            drained, batch = self._inflight
            self._inflight = None
            try:
                self._reply(sock, drained, self._finish(batch, self._writer.results()))
            except redis.RedisError as e:
                log.warning("the last batch's acks were not sent (%s); its producers resend", e)
        self._writer.close()
        sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._denied_log.close()

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP (the authenticator's thread): admit a CURVE client only when its z85 key is listed."""
        ok = self.allowed is not None and self.allowed.allows_key(key.decode("ascii"))
        if not ok:
            self.m_denied.inc()
            z85 = key.decode("ascii")
            self._denied_log.log(z85, "ingest: refused a CURVE handshake from an unlisted key %s", z85)
        return ok

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

    def _check_hash(self, g: Group | GroupHead) -> None:
        """The group's weight_hash must be the hash announced for its weight_version. Announced hashes are
        cached; a mismatch with the cache reads Redis again first (a version re-announced by a learner
        resumed from an older checkpoint), so only a real mismatch is rejected."""
        v = g.weight_version
        if self._hashes.get(v) != g.weight_hash:
            announced = announced_hashes(self.r, self.keys, [v], self.announce_key).get(v)
            if announced is None:  # or only by a forged (unsigned, wrongly signed) announcement
                raise ProtocolError(
                    "weight_hash",
                    f"weight_version {v} was never announced (signed), or is older "
                    "than the announcements kept (learner.publish.keep_announcements)",
                )
            self._hashes[v] = announced
            if announced != g.weight_hash:
                raise ProtocolError(
                    "weight_hash",
                    f"weight_hash {g.weight_hash[:16]!r} is not the hash announced "
                    f"for version {v} ({announced[:16]!r})",
                )

    def _validate(self, g: Group | GroupHead, user_id: str | None) -> None:
        """The checks of a valid group message beyond the message itself, in order: the key's generator
        ids, the run, the versions and their hash."""
        if self.allowed is not None and not self.allowed.allows(user_id or "", g.generator_id):
            raise ProtocolError("wrong_generator", f"key {user_id} may not send as generator {g.generator_id!r}")
        if g.run_id != self.cfg.run_id:
            raise ProtocolError("wrong_run", f"run_id {g.run_id!r} is not this run ({self.cfg.run_id!r})")
        newest = g.max_version
        latest = self._version_ahead(newest)
        if latest is not None:
            raise ProtocolError("version_ahead", f"token version {newest} > latest published {latest}")
        self._check_hash(g)

    def handle_batch(self, payloads: list[bytes | memoryview], user_ids: list[str | None] | None = None) -> list[Ack]:
        """Validate a batch of messages and write it to Redis in one pipeline; one Ack per message, in
        order. ``user_ids``: the CURVE key (z85) each message came with (None without CURVE). Never
        raises for bad input; raises redis errors (then nothing may be acknowledged)."""
        batch = self._prepare(payloads, user_ids)
        return self._finish(batch, batch.pipe.execute() if len(batch.pipe) else [])

    def _prepare(self, payloads: list[bytes | memoryview], user_ids: list[str | None] | None) -> "_Batch":
        """Decode and validate a batch and build its Redis transaction (not yet sent): the rejections'
        counters and dead letters, then the valid groups' messages, staged, and one script call appending
        them."""
        batch = _Batch(self.r.pipeline(), [None] * len(payloads))  # MULTI/EXEC: queues.append_groups
        for i, payload in enumerate(payloads):
            g, m = None, None  # the group, or the message decoded for its reason (its id goes in the ack)
            try:
                if len(payload) <= self.cfg.max_message_bytes:
                    g = decode_group_fast(payload, head_only=True)  # checked whole; only its head is needed
                if g is None:  # not a well-formed group: validated field by field, which names the problem
                    m = unpack_group(payload, self.cfg.max_message_bytes)
                    g = group_from_map(m)
                self._validate(g, user_ids[i] if user_ids else None)
            except ProtocolError as e:
                batch.rejected.append(e.reason)
                batch.pipe.hincrby(self.keys.stats("broker"), f"rejected:{e.reason}", 1)
                batch.pipe.hincrby(self.keys.stats("broker"), "rejected_total", 1)
                if self.cfg.dead_letter_max:
                    queues.dead_letter(batch.pipe, self.keys, e.reason, e.detail, payload, self.cfg.dead_letter_max)
                log.warning("rejected a message: %s", e)
                gid = g.group_id if g is not None else group_id_of(m) if m is not None else group_id_in_head(payload)
                batch.acks[i] = Ack(group_id=gid, status="rejected", reason=e.reason)
                continue
            batch.valid.append((i, g, payload))
        if batch.valid:
            queues.append_groups(
                batch.pipe,
                self.keys,
                self.cfg.max_queue_groups,
                self.cfg.max_queue_bytes,
                [(g, payload) for _, g, payload in batch.valid],
                self.cfg.record_window,
            )
        return batch

    def _finish(self, batch: "_Batch", results: list) -> list[Ack]:
        """The acks of a batch whose transaction returned ``results`` (the script's answer last)."""
        acks = batch.acks
        for reason in batch.rejected:
            self.m_groups.labels("rejected", reason).inc()
        accepted = nbytes = 0  # counted once per batch
        for (i, g, payload), res in zip(batch.valid, results[-1] if batch.valid else []):
            if res == b"B":
                self.m_groups.labels("busy", "").inc()
                acks[i] = Ack(g.group_id, "busy")
            elif res == b"D":
                self.m_groups.labels("duplicate", "").inc()
                acks[i] = Ack(g.group_id, "duplicate")
            else:
                accepted += 1
                nbytes += len(payload)
                acks[i] = Ack(g.group_id, "ok", stream_id=res.decode())
        if accepted:
            self.m_groups.labels("accepted", "").inc(accepted)
            self.m_bytes.inc(nbytes)
        return acks

    def handle(self, payload: bytes) -> Ack:
        """Validate one message and append it (a batch of one)."""
        return self.handle_batch([payload])[0]

    def serve(self, sock: zmq.Socket, timeout_ms: int) -> None:
        """One turn of the ingest loop, pipelined: the batch waiting on ``sock`` (waiting up to
        ``timeout_ms`` for one when nothing is in flight) is drained and validated while the previous
        batch's transaction runs in Redis (written, its replies not yet read: broker/client/overlap.py);
        then the previous batch's replies are read and its acks go out, and this batch's transaction is
        written. With nothing new waiting, the batch in flight is finished at once: an ack is never held
        back for a batch that has not come. A Redis error is raised once the batch in flight failed: none
        of its acks is sent (its producers resend), nor any of the batch drained meanwhile."""
        nxt = None
        if sock.poll(0 if self._inflight is not None else timeout_ms):
            drained = self._drain(sock)
            good = [(payload, user) for _, payload, user in drained if payload is not None]
            nxt = (drained, self._prepare([p for p, _ in good], [u for _, u in good]))
        if self._inflight is not None:
            drained, batch = self._inflight
            self._inflight = None
            self._reply(sock, drained, self._finish(batch, self._writer.results()))  # raises the batch's Redis error
        if nxt is not None:
            drained, batch = nxt
            if len(batch.pipe):
                self._writer.send(batch.pipe)
                self._inflight = nxt
            else:  # only badly framed messages: nothing to write
                self._reply(sock, drained, [])

    def serve_waiting(self, sock: zmq.Socket) -> None:
        """Handle every message waiting on ``sock`` (one batch) and send their acks, unpipelined."""
        drained = self._drain(sock)
        good = [(payload, user) for _, payload, user in drained if payload is not None]
        self._reply(sock, drained, self.handle_batch([p for p, _ in good], [u for _, u in good]))

    @staticmethod
    def _reply(sock: zmq.Socket, drained: list, acks: list[Ack]) -> None:
        """One ack per drained message, in order: the batch's acks for the well-framed ones."""
        it = iter(acks)
        for ident, payload, _ in drained:
            sock.send_multipart(
                [ident, b"", encode_ack(next(it) if payload is not None else Ack("", "rejected", "bad_framing"))]
            )

    def _drain(self, sock: zmq.Socket) -> list[tuple[bytes, memoryview | None, str | None]]:
        """Every message waiting on the socket, up to the batch limits: (identity, payload, the CURVE
        key it came with), payload None for a badly framed one (counted here, answered 'rejected' with
        an empty group id, never appended). Payloads are views of ZeroMQ's frames (not copied)."""
        batch, nbytes = [], 0
        while len(batch) < INGEST_BATCH and nbytes < INGEST_BATCH_BYTES:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            ident = frames[0].bytes
            if len(frames) != 3 or len(frames[1]) != 0:
                self._count("rejected", "bad_framing")
                batch.append((ident, None, None))
                continue
            user = frames[2].get("User-Id") if self.allowed is not None else None
            batch.append((ident, frames[2].buffer, user))
            nbytes += len(frames[2])
        return batch
