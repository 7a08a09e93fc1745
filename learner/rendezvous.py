"""The collective transport's rendezvous, learner side: who may join the weight broadcast.

One listening socket on ``weights.transport.host``:``port`` (that address only), served by one thread
with a selector: no thread per connection. A join, as a generator speaks it (generators/weight_receive.py;
the frames in broker/protocol/collective.py):

1. the learner sends a fresh challenge;
2. the generator answers with its id, a session, a nonce and the proof that it holds the run's weights
   key (broker/protocol/weightauth.py ``join_proof``). A connection that does not answer within
   :data:`JOIN_DEADLINE_S`, sends more than a few KiB, or whose proof is wrong is closed without a word:
   it got nothing but the challenge and cost the learner one HMAC (counted: ``refused_unauthenticated``);
3. an id already connected is refused (``refused``; the live member keeps its place), and so is a join
   past ``weights.transport.max_members``; else the learner proves the key back (``accepted``) and
   builds the 2-rank gloo group, the group's store being this same connection (an in-process HashStore
   here, ``RemoteStore`` on the generator's side);
4. before any weight goes out, the learner broadcasts a fresh nonce over the new group and the generator
   answers, on the connection, with its HMAC: the process at the other end of the group's own sockets
   holds the key (one that connected to the group's port first would get a nonce it cannot answer);
5. the connection stays open, silent, as long as the membership: when it ends (the generator left or
   exited, its machine is gone: TCP keep-alive, ~25 s), the member is dropped at once, so a restarted
   generator rejoins under its id while a live one is never evicted.

Threads: the selector's, plus at most :data:`BUILDERS` groups built at a time (each with one thread for
gloo's constructor beside the one that serves its store); authenticated joins beyond those wait in a
queue of :data:`MAX_QUEUED`; beyond :data:`MAX_PENDING` connections still to authenticate, a new one is
closed at once.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from broker.protocol import collective as wire
from broker.protocol import weightauth

log = logging.getLogger("relay.learner.rendezvous")

JOIN_DEADLINE_S = 5.0  # a connection must have sent its join by then
MAX_PENDING = 128  # connections still to authenticate, at once
BUILDERS = 4  # groups built at once
MAX_QUEUED = 16  # authenticated joins waiting for a builder
MAX_STORE_KEYS = 64  # keys a joining generator may set in its group's store
LOG_EVERY_S = 10.0  # refused joins are logged at most this often (with the count since)


@dataclass
class JoinRequest:
    generator: str
    session: str
    nonce: str
    challenge: str


@dataclass
class _Pending:
    conn: socket.socket
    deadline: float
    challenge: str
    reader: wire.FrameReader = field(default_factory=lambda: wire.FrameReader(wire.MAX_JOIN_FRAME))


@dataclass
class _Live:
    conn: socket.socket
    ticket: int
    generator: str


class Membership:
    """Who is joining or a member, by generator id, and the admission bounds: one place per id (a restarted
    generator is admitted once its old connection has ended), at most ``max_members``, at most
    :data:`MAX_QUEUED` + :data:`BUILDERS` groups waiting or being built. Used by the selector's thread and
    the builders' threads, under its lock."""

    def __init__(self, max_members: int):
        self.max_members = max_members
        self.lock = threading.Lock()
        self.ids: dict[str, int] = {}  # generator id -> its ticket, while building or a member
        self.tickets = 0
        self.queued = 0

    def admit(self, generator: str) -> tuple[int, None] | tuple[None, tuple[str, str]]:
        """``(ticket, None)``, the join queued for a builder; or ``(None, (counter, reason))``, refused."""
        with self.lock:
            if generator in self.ids:
                return None, (
                    "refused_duplicate",
                    f"generator {generator!r} is already connected (a generator "
                    f"that restarted is admitted once its old connection has ended)",
                )
            if len(self.ids) >= self.max_members:
                return None, (
                    "refused_full",
                    f"the broadcast has {self.max_members} members (weights.transport.max_members)",
                )
            if self.queued >= MAX_QUEUED + BUILDERS:
                return None, ("refused_busy", "too many joins at once; try again")
            self.tickets += 1
            self.ids[generator] = self.tickets
            self.queued += 1
            return self.tickets, None

    def building(self) -> None:
        """A builder took a queued join."""
        with self.lock:
            self.queued -= 1

    def release(self, generator: str, ticket: int) -> None:
        """``generator``'s place, if ``ticket`` still holds it (its group failed, or its connection ended)."""
        with self.lock:
            if self.ids.get(generator) == ticket:
                del self.ids[generator]


class Tally:
    """Joins counted by outcome (``counts``); refusals logged at most every :data:`LOG_EVERY_S`, with the
    number since the last line (a flood of joins writes a few lines, not one per join)."""

    def __init__(self):
        self.counts = {
            "joined": 0,
            "refused_unauthenticated": 0,
            "refused_duplicate": 0,
            "refused_full": 0,
            "refused_busy": 0,
            "failed": 0,
            "left": 0,
        }
        self._since_log, self._logged_at = 0, 0.0

    def refused(self, what: str, why: str = "") -> None:
        self.counts[what] += 1
        self._since_log += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning(
                "rendezvous: refused %d join(s) in the last %.0f s (the last: %s%s)",
                self._since_log,
                min(now - self._logged_at, 1e9) if self._logged_at else 0,
                what,
                f", {why}" if why else "",
            )
            self._logged_at, self._since_log = now, 0


class Rendezvous:
    """Admits generators to the weight broadcast (see the module's docstring). ``on_join(ticket, generator,
    session, pg, close)`` makes a member of a group built (``close()`` ends its membership: the connection
    is shut, ``on_leave`` follows); ``on_leave(ticket, generator, why)`` when a member's connection ended.
    ``key``: the run's weights key (None: ``weights.auth = "insecure"``, any join is admitted)."""

    def __init__(
        self,
        host: str,
        port: int,
        key: bytes | None,
        run_id: str,
        timeout_s: float,
        max_members: int,
        on_join: Callable,
        on_leave: Callable[[int, str, str], None],
    ):
        self.key, self.run_id, self.timeout_s = key, run_id, timeout_s
        self.on_join, self.on_leave = on_join, on_leave
        self.host = host
        self.sock = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128
        )
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._handoff: queue.SimpleQueue = queue.SimpleQueue()  # (conn, ticket, generator) built: watch them
        self.stop = threading.Event()
        self.members = Membership(max_members)
        self.pending: dict[socket.socket, _Pending] = {}
        self.tally = Tally()
        self._builders = _BoundedPool(BUILDERS)
        self._thread = threading.Thread(target=self._loop, name="relay-collective-rendezvous", daemon=True)

    @property
    def counts(self) -> dict[str, int]:
        return self.tally.counts

    @property
    def ids(self) -> dict[str, int]:
        """Generator id -> ticket, of the joins being built and the members."""
        return self.members.ids

    def start(self) -> "Rendezvous":
        self._thread.start()
        log.info(
            "collective rendezvous on %s:%d (%s)",
            self.host,
            self.port,
            "joins prove the run's weights key"
            if self.key is not None
            else "no authentication: weights.auth insecure, whoever reaches the port receives the weights",
        )
        return self

    def close(self) -> None:
        self.stop.set()
        self._wake()
        self._thread.join(5.0)
        self._builders.shutdown()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # -- the selector's thread --------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                for key, _ in self.sel.select(timeout=0.5):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    elif isinstance(key.data, _Pending):
                        self._read_join(key.data)
                    else:
                        self._read_live(key.data)
                now = time.monotonic()
                for p in [p for p in self.pending.values() if p.deadline < now]:
                    self._refuse_quietly(p, "no join in time")
        finally:
            for k in list(self.sel.get_map().values()):
                if isinstance(k.fileobj, socket.socket):
                    k.fileobj.close()
            self.sel.close()
            self._wake_w.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                conn, ticket, generator = self._handoff.get_nowait()
            except queue.Empty:
                return
            conn.setblocking(False)
            self.sel.register(conn, selectors.EVENT_READ, _Live(conn, ticket, generator))

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, say: the listener stays
                log.warning("rendezvous: accept failed: %s", e)
                return
            if len(self.pending) >= MAX_PENDING:
                conn.close()
                self.tally.refused("refused_busy")
                continue
            conn.setblocking(False)
            challenge = secrets.token_hex(32)
            try:
                conn.send(wire.frame({"kind": "challenge", "v": wire.RENDEZVOUS_VERSION, "challenge": challenge}))
            except OSError:
                conn.close()
                continue
            p = _Pending(conn, time.monotonic() + JOIN_DEADLINE_S, challenge)
            self.pending[conn] = p
            self.sel.register(conn, selectors.EVENT_READ, p)

    def _forget(self, conn: socket.socket) -> None:
        self.pending.pop(conn, None)
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass

    def _refuse_quietly(self, p: _Pending, why: str) -> None:
        """Close a connection that did not prove the key: nothing said, counted, logged now and then."""
        self._forget(p.conn)
        p.conn.close()
        self.tally.refused("refused_unauthenticated", why)

    def _read_join(self, p: _Pending) -> None:
        try:
            data = p.conn.recv(4096)
            if not data:
                raise ConnectionError("closed")
            p.reader.feed(data)
            msg = p.reader.next()
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, wire.FrameError) as e:
            self._refuse_quietly(p, str(e))
            return
        if msg is None:
            return
        req = self._check_join(msg, p.challenge)
        if req is None:
            self._refuse_quietly(p, "no valid proof of the weights key")
            return
        self._forget(p.conn)
        ticket, refusal = self.members.admit(req.generator)
        if refusal is not None:
            self.tally.refused(refusal[0], refusal[1])
            _send_quietly(p.conn, {"kind": "refused", "reason": refusal[1]})
            p.conn.close()
            return
        p.conn.setblocking(True)
        self._builders.submit(self._build, p.conn, ticket, req)

    def _check_join(self, msg: dict, challenge: str) -> JoinRequest | None:
        try:
            if msg.get("kind") != "join":
                return None
            req = JoinRequest(str(msg["generator"]), str(msg["session"]), str(msg["nonce"]), challenge)
            proof = str(msg.get("proof", ""))
        except (KeyError, TypeError):
            return None
        if not (0 < len(req.generator) <= 128 and 0 < len(req.session) <= 64 and len(req.nonce) <= 128):
            return None
        if self.key is not None and not weightauth.same(
            proof, weightauth.join_proof(self.key, self.run_id, challenge, req.nonce, req.generator, req.session)
        ):
            return None
        return req

    def _read_live(self, m: _Live) -> None:
        try:
            data = m.conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            data, why = b"", str(e)
        else:
            why = "its connection closed" if not data else ""
        if data:
            return  # a member has nothing to say once admitted: ignored
        self._forget(m.conn)
        m.conn.close()
        self.members.release(m.generator, m.ticket)
        self.counts["left"] += 1
        self.on_leave(m.ticket, m.generator, why)

    # -- a builder's thread ----------------------------------------------------------------------

    def _build(self, conn: socket.socket, ticket: int, req: JoinRequest) -> None:
        self.members.building()
        try:
            pg = build_group(conn, ticket, req, self.host, self.key, self.run_id, self.timeout_s)
        except (OSError, RuntimeError, ValueError, wire.FrameError) as e:
            self.counts["failed"] += 1
            log.warning(
                "generator %s could not join the weight broadcast: %s",
                req.generator,
                str(e).splitlines()[0][:200] if str(e) else type(e).__name__,
            )
            conn.close()
            self.members.release(req.generator, ticket)
            return
        self.counts["joined"] += 1

        def close() -> None:  # the member is dropped: the selector sees the connection end, on_leave follows
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        self.on_join(ticket, req.generator, req.session, pg, close)
        self._handoff.put((conn, ticket, req.generator))
        self._wake()


def build_group(
    conn: socket.socket, ticket: int, req: JoinRequest, host: str, key: bytes | None, run_id: str, timeout_s: float
):
    """Accept ``req`` (a builder's thread), build its 2-rank gloo group on ``host`` (serving the group's store
    on ``conn``), check that the peer of the group holds the weights ``key``; returns the group."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    conn.settimeout(timeout_s)
    wire.keepalive(conn)
    accept = (
        weightauth.accept_proof(key, run_id, req.challenge, req.nonce, req.generator, req.session)
        if key is not None
        else ""
    )
    conn.sendall(wire.frame({"kind": "accepted", "ticket": ticket, "proof": accept}))
    store = dist.HashStore()
    store.set_timeout(timeout)
    built: dict = {}

    def construct() -> None:
        try:
            built["pg"] = wire.gloo_group(store, "m", 0, host, timeout_s)
        except RuntimeError as e:
            built["error"] = e

    t = threading.Thread(target=construct, name=f"relay-collective-group-{ticket}", daemon=True)
    t.start()
    try:
        _serve_store(conn, store, timeout)
    finally:
        t.join(timeout_s)
    if "pg" not in built:
        raise RuntimeError(f"its group was not built: {built.get('error', 'timed out')}")
    pg = built["pg"]
    try:
        nonce = torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8)
        pg.broadcast(nonce, 0, timeout).wait()
        answer = wire.read_frame(conn)
        if key is not None and not (
            answer.get("op") == "pair"
            and weightauth.same(
                str(answer.get("mac", "")),
                weightauth.join_proof(key, run_id, "pair", bytes(nonce.numpy()).hex(), req.generator, req.session),
            )
        ):
            raise ValueError(
                "the peer of its group did not prove the weights key (another process connected "
                "to the group's port first?)"
            )
        conn.sendall(wire.frame({"kind": "member"}))
    except BaseException:
        wire.abort_group(pg)
        raise
    return pg


def _serve_store(conn: socket.socket, store, timeout: datetime.timedelta) -> None:
    """Answer the joining generator's store operations on ``conn`` until it says ``ready`` (its group built)."""
    keys = 0
    while True:
        msg = wire.read_frame(conn)
        op = msg.get("op")
        if op == "ready":
            return
        try:
            if op == "set":
                keys += 1
                if keys > MAX_STORE_KEYS:
                    raise ValueError(f"more than {MAX_STORE_KEYS} keys set")
                store.set(str(msg["key"]), bytes(msg["value"]))
                value = None
            elif op == "get":
                value = bytes(store.get(str(msg["key"])))
            elif op == "wait":
                wait_s = min(float(msg.get("timeout_s") or timeout.total_seconds()), timeout.total_seconds())
                store.wait([str(k) for k in msg["keys"]], datetime.timedelta(seconds=wait_s))
                value = None
            elif op == "check":
                value = bool(store.check([str(k) for k in msg["keys"]]))
            elif op == "add":
                value = int(store.add(str(msg["key"]), int(msg["n"])))
            else:
                raise ValueError(f"unknown store operation {op!r}")
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            conn.sendall(wire.frame({"ok": False, "error": str(e).splitlines()[0][:300] if str(e) else "error"}))
            continue
        conn.sendall(wire.frame({"ok": True, "value": value}))


def _send_quietly(conn: socket.socket, msg: dict) -> None:
    try:
        conn.setblocking(True)
        conn.settimeout(1.0)
        conn.sendall(wire.frame(msg))
    except OSError:
        pass


class _BoundedPool:
    """At most ``n`` daemon threads, started as the first jobs come, taking jobs from a queue (the admission
    above bounds the queue). Daemon threads: a build blocked in gloo never holds up the learner's exit."""

    def __init__(self, n: int):
        self.n, self.jobs, self.threads = n, queue.SimpleQueue(), []

    def submit(self, fn, *args) -> None:
        if len(self.threads) < self.n:  # only the selector's thread submits
            t = threading.Thread(target=self._work, name=f"relay-collective-builder-{len(self.threads)}", daemon=True)
            self.threads.append(t)
            t.start()
        self.jobs.put((fn, args))

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, args = job
            fn(*args)

    def shutdown(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)
