"""The ``collective`` weight transport, generator side: a thread that receives versions broadcast by
the learner (learner/broadcast.py; the wire format in broker/protocol/collective.py).

The generator first loads the newest stored version as with every transport (late joiners and
restarts catch up from the store), then :meth:`Receiver.start` joins: it reads the learner's
rendezvous address from Redis (``Keys.collective``), connects, proves it holds the run's weights key
(and checks the learner proves it back), builds its side of a 2-rank gloo group whose store is that
connection (:class:`RemoteStore`), and answers the learner's nonce sent over the new group; the
connection then stays open as long as it is a member (broker/protocol/collective.py, learner/rendezvous.py).
A join refused because its id is still connected (the learner has not yet seen this generator's previous
connection end) is tried again a second later. Each version lands in a fresh
CPU staging buffer, bucket by bucket; each tensor is hashed as soon as its last byte has landed
(a hashing thread, meanwhile the next buckets arrive). A version is *ready* only when the trailer's
signature checks (the run's public announcement key) and the digest of the bytes received equals the signed
digest; otherwise it is *rejected* (kept for the WeightApplier to refuse and flag, never applied).
The WeightApplier (generators/weights.py) takes the newest ready version between batches (and
between decode steps with in_flight=continue). Versions that arrive while an older one waits replace
it (the newest wins; the older is never applied).

On any failure of the group (the learner dropped this generator, or died, or a timeout) the thread
waits a second and joins again, through whatever address Redis then advertises; meanwhile the
generator follows the announcements and the store, as with ``transport = "store"``.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import redis
import torch
import torch.distributed as dist

from broker.protocol import collective as wire
from broker.protocol import signing, weightauth
from broker.protocol.keys import Keys
from broker.protocol.tensordigest import combine
from broker.protocol.weights_config import CollectiveTransport
from generators.transports import ReceiverContext, Receiving

log = logging.getLogger("relay.generator.receive")

HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))  # hashing releases the GIL: tensors hash in parallel
IDLE_WAIT = datetime.timedelta(days=1)  # a header may be long in coming (a dead learner fails the wait at once)


@dataclass
class Received:
    """One version received over the collective. ``problem`` is None for a version that may be applied;
    else why it must be refused (``digest_mismatch``, ``bad_signature``, ``unsigned``)."""

    version: int
    digest: str  # the digest of the bytes received
    state: dict[str, torch.Tensor] = field(repr=False)
    problem: str | None = None
    signed_digest: str = ""  # the digest the learner signed
    received_at: float = 0.0
    seconds: float = 0.0  # from the header to the trailer
    flat: torch.Tensor | None = field(default=None, repr=False)  # the staging buffer the state views


class Staging:
    """What the in-process transports share (this collective receiver, generators/ipc_receive.py): the
    versions received, handed to the WeightApplier (generators/weights.py) by ``take(after)`` (the newest
    good version newer than ``after``) and ``take_rejected()``, and the staging buffers they land in,
    reused through ``recycle``. A subclass's thread calls :meth:`_deliver` with each version received."""

    via = ""  # how the versions arrive: the ``via`` of the generator's applied events

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)  # where the staging buffers live (the engine's device)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ready: Received | None = None  # the newest good version not yet taken
        self.rejects: list[Received] = []  # versions refused on arrival, not yet reported
        self.joined = threading.Event()  # set while this generator receives from the learner
        self.received = 0
        self.rejected = 0
        self.aborted = 0  # versions the learner aborted mid-transfer (non-finite weights): discarded
        self.joins = 0
        self._thread: threading.Thread | None = None
        self._spare: torch.Tensor | None = None  # a staging buffer no longer in use (reused: no page faults)
        self._held: torch.Tensor | None = None  # the staging buffer the engine's weights live in (adopted)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> "Staging":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"relay-{self.via}-receive", daemon=True)
            self._thread.start()
        return self

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the thread and wait for it (at most ``wait_s``): a process that exits while it is inside
        torch's C++ code may abort."""
        self.stop.set()
        self._interrupt()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(wait_s)

    def running(self) -> bool:
        """Whether the receiving thread is still alive (after :meth:`close`: it did not end in time)."""
        return self._thread is not None and self._thread.is_alive()

    def _interrupt(self) -> None:
        """Wake the thread from a wait (a subclass's socket or poll)."""

    def take(self, after: int | None) -> Received | None:
        """The newest good version received since the last call, if newer than ``after``."""
        with self.lock:
            got, self.ready = self.ready, None
        if got is not None and after is not None and got.version <= after:
            return None
        return got

    def recycle(self, got: Received, adopted: bool = False) -> None:
        """``got`` was applied. Copied into the engine (or refused): its staging buffer may hold the next
        version. ``adopted`` (the engine's weights now live in that buffer): the buffer the engine held
        before, when it was one of these, is the one free for the next version."""
        with self.lock:
            if got.flat is None:
                return
            free = got.flat
            if adopted:
                free, self._held = self._held, got.flat
            size = got.flat.numel()
            got.flat, got.state = None, {}
            if free is not None:
                self._spare = free
            elif self._spare is None:  # the first adoption: the engine's own tensors were freed, not handed back
                threading.Thread(
                    target=self._prefault, args=(size,), name="relay-staging-prefault", daemon=True
                ).start()

    def _prefault(self, size: int) -> None:
        """Allocate the next version's staging buffer now, while idle, and touch every page (the kernel maps
        them as they are first written: done here, not while a version lands)."""
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        buf.fill_(0)
        with self.lock:
            if self._spare is None:
                self._spare = buf

    def _buffer(self, size: int) -> torch.Tensor:
        with self.lock:
            spare, self._spare = self._spare, None
        return (
            spare
            if spare is not None and spare.numel() == size
            else torch.empty(size, dtype=torch.uint8, device=self.device)
        )

    def _discard(self, flat: torch.Tensor) -> None:
        """A staging buffer whose version will never be applied: it takes the next one."""
        with self.lock:
            self._spare = flat

    def _deliver(self, got: Received) -> None:
        """``got`` has arrived: ready for ``take`` (it replaces a ready one not yet taken, never applied) or,
        with a ``problem``, kept for ``take_rejected`` (its buffer reused)."""
        self.received += 1
        if got.problem is not None:
            self.rejected += 1
            log.error("version %d received via %s is refused (%s)", got.version, self.via, got.problem)
        with self.lock:
            if got.problem is not None:
                self._spare, got.state, got.flat = got.flat, {}, None  # never applied: its buffer is reused
                self.rejects.append(got)
            else:
                if self.ready is not None:  # superseded before it was taken: never applied
                    self._spare = self.ready.flat
                self.ready = got

    def take_rejected(self) -> list[Received]:
        """The versions refused on arrival (bad signature, digest mismatch) since the last call."""
        with self.lock:
            out, self.rejects = self.rejects, []
        return out

    def catch_up(self, version: int, timeout: float = 10.0) -> bool:
        """``version`` is announced and not delivered: True once this receiver has handled it (waiting at
        most ``timeout``), False to load it from the store. Here: False (a broadcast version arrives before
        its announcement or not at all)."""
        return False


class Receiver(Staging):
    """The collective transport's receiver. ``tamper(bucket_index, bucket)`` is a test hook: it may alter a
    bucket right after it landed, as a faulty link would."""

    via = "collective"

    def __init__(
        self,
        r,
        keys: Keys,
        cfg: CollectiveTransport,
        generator_id: str,
        announce_key: signing.AnnounceVerifier | None,
        weights_key: bytes | None = None,
        max_bytes: int = 1 << 40,
        tamper: Callable[[int, torch.Tensor], None] | None = None,
    ):
        super().__init__("cpu")  # gloo receives into host memory
        self.r, self.keys, self.cfg, self.generator_id, self.key = r, keys, cfg, generator_id, announce_key
        self.weights_key = weights_key  # proves this generator may join (None: weights.auth insecure)
        self._conn: socket.socket | None = None  # the rendezvous connection: open while a member
        self._not_joined = ""  # why the last join failed (logged once per reason)
        self.max_bytes, self.tamper = max_bytes, tamper
        self.pg = None
        self._hashers = [ThreadPoolExecutor(1, thread_name_prefix="relay-digest") for _ in range(HASH_THREADS)]

    def close(self, wait_s: float = 5.0) -> None:
        """Leave the group and wait for the thread (at most ``wait_s``). A receive blocked in gloo ends only
        when the learner's side of the group goes (aborting ours does not wake it): closing the rendezvous
        connection makes the learner drop this member, which closes the group's connections and fails the
        receive, so the thread leaves before the process exits (a process that exits while the thread is
        still inside gloo may abort: "terminate called without an active exception")."""
        self.stop.set()
        self._interrupt()
        self._leave()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(wait_s)
            if self._thread.is_alive():
                log.warning("the collective receive thread did not end within %.0f s of leaving the group", wait_s)

    def _interrupt(self) -> None:
        pg = self.pg
        if pg is not None:
            wire.abort_group(pg)

    def _leave(self) -> None:
        """End the membership: the learner sees the rendezvous connection close and frees this id."""
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self._join()
                while not self.stop.is_set():
                    self._receive_one()
            except (redis.RedisError, RuntimeError, ValueError, OSError) as e:  # the group failed, or no learner yet
                why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                if self.joined.is_set():
                    log.warning("left the weight broadcast (%s); following the store until it joins again", why)
                elif why != self._not_joined and "not opened its rendezvous" not in why:
                    log.warning(
                        "cannot join the weight broadcast (%s); following the store, trying again every second", why
                    )  # once per reason: a refused key or id is seen, not repeated
                self._not_joined = why
                self.joined.clear()
                if self.pg is not None:
                    wire.abort_group(self.pg)
                    self.pg = None
                self._leave()
                self.stop.wait(1.0)

    def _join(self) -> None:
        addr = self.r.hgetall(self.keys.collective)
        if not addr:
            raise RuntimeError("the learner has not opened its rendezvous yet")
        host, port = addr[b"host"].decode(), int(addr[b"port"])
        conn = socket.create_connection((host, port), timeout=self.cfg.timeout_s)
        self._conn = conn
        wire.keepalive(conn)
        hello = wire.read_frame(conn, wire.MAX_JOIN_FRAME)
        if hello.get("kind") != "challenge":
            raise ValueError(f"{host}:{port} is not a Relay rendezvous (it said {str(hello)[:100]})")
        challenge, session, nonce = str(hello["challenge"]), secrets.token_hex(8), secrets.token_hex(32)
        key, run, gid = self.weights_key, self.keys.run_id, self.generator_id
        proof = weightauth.join_proof(key, run, challenge, nonce, gid, session) if key is not None else ""
        conn.sendall(wire.frame({"kind": "join", "generator": gid, "session": session, "nonce": nonce, "proof": proof}))
        try:
            answer = wire.read_frame(conn, wire.MAX_JOIN_FRAME)
        except ConnectionError:
            raise ConnectionError(
                "the learner closed the rendezvous connection without an answer: it does not take "
                "this generator's weights key (weights.key_file) for the run's"
            ) from None
        if answer.get("kind") == "refused":
            raise RuntimeError(f"the learner refused the join: {answer.get('reason')}")
        if answer.get("kind") != "accepted" or (
            key is not None
            and not weightauth.same(
                str(answer.get("proof", "")), weightauth.accept_proof(key, run, challenge, nonce, gid, session)
            )
        ):
            raise ValueError(f"{host}:{port} did not prove the run's weights key: not the learner")
        ticket = int(answer["ticket"])
        self.pg = wire.gloo_group(RemoteStore(conn), "m", 1, host, self.cfg.timeout_s)
        conn.sendall(wire.frame({"op": "ready"}))
        pair = torch.zeros(32, dtype=torch.uint8)  # the learner's nonce, over the group itself
        self.pg.broadcast(pair, 0, datetime.timedelta(seconds=self.cfg.timeout_s)).wait()
        mac = (
            weightauth.join_proof(key, run, "pair", pair.numpy().tobytes().hex(), gid, session)
            if key is not None
            else ""
        )
        conn.sendall(wire.frame({"op": "pair", "mac": mac}))
        if wire.read_frame(conn).get("kind") != "member":
            raise RuntimeError("the learner did not admit this generator once its group was built")
        conn.settimeout(None)  # silent from now on: open as long as the membership
        self.joins += 1
        self.joined.set()
        log.info("joined the weight broadcast at %s:%d (ticket %d)", host, port, ticket)

    def _blob(self, timeout: datetime.timedelta) -> bytes:
        n = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast(n, 0, timeout).wait()
        size = int(n[0])
        if not 0 <= size <= wire.MAX_BLOB:
            raise ValueError(f"a blob of {size} bytes (at most {wire.MAX_BLOB})")
        body = torch.empty(size, dtype=torch.uint8)
        if size:
            self.pg.broadcast(body, 0, timeout).wait()
        return body.numpy().tobytes()

    def _receive_one(self) -> None:
        header = self._blob(IDLE_WAIT)
        t0 = time.perf_counter()
        timeout = datetime.timedelta(seconds=self.cfg.timeout_s)
        version, layout = wire.parse_header(header, self.max_bytes)  # malformed: the group is left (ValueError)
        flat = self._buffer(layout.total)
        hashes = wire.BucketHasher(layout, flat, self._hashers)
        buckets = layout.buckets or [(0, 0)]
        # every bucket's receive posted at once (the group's threads fill them in order, no gap between
        # two), each waited for in turn and hashed as soon as it has landed (still warm in the cache)
        works = [self.pg.broadcast(flat[start:end], 0, timeout) if end > start else None for start, end in buckets]
        for i, (start, end) in enumerate(buckets):
            if works[i] is not None:
                works[i].wait()
                if self.tamper is not None:
                    self.tamper(i, flat[start:end])
            hashes.add(start, end)
        trailer = wire.parse_trailer(self._blob(timeout))
        digest = combine(hashes.entries(), layout.digest)
        problem = None
        if self.key is not None:
            problem = signing.check_collective(
                self.key,
                self.keys.run_id,
                trailer["version"],
                trailer["digest"],
                trailer["header_sha256"],
                trailer["sig"],
            )
        if problem is None and (
            trailer["version"] != version or trailer["header_sha256"] != hashlib.sha256(header).hexdigest()
        ):
            problem = "header_mismatch"
        if problem is None and trailer["abort"] and not trailer["digest"]:  # refused by the learner on the way
            self.aborted += 1
            log.warning(
                "version %d received over the collective was aborted by the learner (%s): discarded",
                version,
                trailer["abort"][:200],
            )
            self._discard(flat)
            return
        if problem is None and trailer["digest"] != digest:
            problem = "digest_mismatch"
        state = {
            s.name: flat[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).reshape(s.shape)
            for s in layout.slots
        }
        got = Received(version, digest, state, problem, trailer["digest"], time.time(), time.perf_counter() - t0, flat)
        self._deliver(got)
        log.debug("received version %d (%.1f MiB) in %.3fs", version, layout.total / (1 << 20), got.seconds)


class RemoteStore(dist.Store):
    """The store of a gloo group being built, kept by the learner: each operation is one frame on the
    rendezvous connection and its answer (broker/protocol/collective.py, step 4). Only what gloo's
    rendezvous uses (set, get, wait, check, add)."""

    def __init__(self, conn: socket.socket):
        super().__init__()
        self.conn = conn
        self.lock = threading.Lock()  # gloo may call from more than one thread

    def _call(self, **msg):
        with self.lock:
            self.conn.sendall(wire.frame(msg))
            answer = wire.read_frame(self.conn)
        if not answer.get("ok"):
            raise RuntimeError(f"the learner's store: {answer.get('error', 'refused')}")
        return answer.get("value")

    def set(self, key, value) -> None:
        self._call(op="set", key=str(key), value=bytes(value.encode() if isinstance(value, str) else value))

    def get(self, key) -> bytes:
        return bytes(self._call(op="get", key=str(key)))

    def wait(self, keys, timeout=None) -> None:
        self._call(
            op="wait",
            keys=[str(k) for k in keys],
            timeout_s=timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None,
        )

    def check(self, keys) -> bool:
        return bool(self._call(op="check", keys=[str(k) for k in keys]))

    def add(self, key, amount) -> int:
        return int(self._call(op="add", key=str(key), n=int(amount)))


def receiving(ctx: ReceiverContext) -> Receiving:
    """``weights.transport = "collective"``, generator side (generators/transports.py): a :class:`Receiver`
    that joins the learner's broadcast with the weights key."""
    cfg = ctx.cfg
    return Receiving(
        tensors=Receiver(ctx.r, ctx.keys, cfg.weights.transport, cfg.id, ctx.announce_key, ctx.weights_key)
    )
