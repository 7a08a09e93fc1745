"""The ZeroMQ group sender: how a producer hands groups to the broker and waits for their acks.

Failure behaviour: a group is kept until the broker acknowledges it. No reply within ``timeout_s``
-> the socket is rebuilt and the *same bytes* (same group id) are resent; the broker de-duplicates,
so a resend can never be trained twice. ``busy`` (queue full) -> wait and resend: that is the
back-pressure a generator feels.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from broker.client.connection import Backoff, split_addresses
from broker.protocol.codec import ProtocolError
from broker.protocol.ingest_auth import CurveClientKeys
from broker.protocol.messages import Ack, decode_ack

log = logging.getLogger(__name__)

_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class GroupSender:
    """Sends encoded groups to the broker and waits for each acknowledgement (lazy-pirate pattern).

    ``send`` returns the broker's final Ack: ``ok``/``duplicate`` (safe in Redis), or ``rejected``
    (invalid; never resent). ``busy`` and timeouts are retried inside ``send`` until
    ``give_up_s``; then ``TimeoutError`` is raised and the caller still holds the group.
    ``send_many`` keeps several groups in flight on the same socket (a bulk producer's path).
    ``address``: one ZeroMQ address, or several comma-separated (one per broker ingest worker,
    ``RunInfo.ingest_addresses``): the socket connects to each and ZeroMQ spreads the groups over them.
    """

    def __init__(
        self, address: str, timeout_s: float = 10.0, busy_wait_s: float = 0.05, curve: CurveClientKeys | None = None
    ):
        self.address = address
        self.curve = curve  # None: plain ZMTP (a broker with ingest_auth = "insecure")
        self.timeout_s = timeout_s
        self.busy_wait_s = busy_wait_s
        self.ctx = zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.resends = 0
        self.busy_waits = 0
        self._connect()

    def _connect(self, monitor: bool = False) -> zmq.Socket | None:
        """A new DEALER connected to every address; ``monitor``: with a socket that reports its handshakes
        (attached before it connects, so none is missed), returned."""
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(self.sock)
        events = None
        if monitor:
            events = self.sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        for address in split_addresses(self.address):  # several ingest workers: groups spread round-robin
            self.sock.connect(address)
        return events

    def wait_connected(self, timeout_s: float = 10.0) -> None:
        """Reconnect and block until the handshake with every address has succeeded (with CURVE: the broker
        admitted this key), so that the first groups are not held back by it nor all sent to the worker
        that answered first. ``PermissionError`` when a broker refused the key (it is not in the
        allow-list, or ``ingest_auth`` differs), ``TimeoutError`` after ``timeout_s`` (a broker down)."""
        from zmq.utils.monitor import recv_monitor_message

        events = self._connect(monitor=True)
        waiting = set(split_addresses(self.address))
        deadline = time.monotonic() + timeout_s
        try:
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0 or not events.poll(int(left * 1000)):
                    raise TimeoutError(
                        f"no handshake with {', '.join(sorted(waiting))} in {timeout_s}s (is the broker "
                        "up, and does ingest_auth match?)"
                    )
                event = recv_monitor_message(events)
                endpoint = event["endpoint"].decode() if isinstance(event["endpoint"], bytes) else event["endpoint"]
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    waiting.discard(endpoint)
                elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    raise PermissionError(
                        f"broker {endpoint} refused this producer's key (status {event['value']}): "
                        "is it in the broker's allow-list (docs/security.md)?"
                    )
                else:  # a protocol error, or no detail: most often one side with CURVE and the other without
                    raise ConnectionError(
                        f"handshake with {endpoint} failed (ZeroMQ event {event['event']}): does "
                        "ingest_auth match the broker's?"
                    )
        finally:
            self.sock.disable_monitor()
            events.close(linger=0)

    def send(
        self, group_id: str, payload: bytes, give_up_s: float = 3600.0, should_stop=lambda: False, on_busy=lambda: None
    ) -> Ack:
        """Send one group and return its final Ack (``ok``/``duplicate``/``rejected``): ``send_many``
        with a window of one, so the retry, back-off and resend rules are the same. ``group_id`` may
        be empty for a payload that carries none (the broker answers ``rejected`` with no id)."""
        return self.send_many(
            [(group_id, payload)], window=1, give_up_s=give_up_s, should_stop=should_stop, on_busy=on_busy
        )[group_id]

    def send_many(
        self,
        items: list[tuple[str, bytes]],
        window: int = 64,
        give_up_s: float = 3600.0,
        should_stop=lambda: False,
        on_busy=lambda: None,
    ) -> dict[str, Ack]:
        """Send several groups keeping up to ``window`` of them in flight; return each one's final Ack
        by group id (``ok``/``duplicate``/``rejected``, as ``send``).

        Acks are matched by group id, so the ids must be distinct (and non-empty), and each payload
        must carry its id (as ``encode_group`` writes it). ``busy``: that group goes back to the
        front of the queue, ``on_busy()`` is called (so the caller can report it is paused by
        back-pressure) and nothing is sent for a wait of ``busy_wait_s`` that grows by 1.5 with each
        consecutive ``busy`` ack, up to 1 s (any other final ack resets it). No
        ack at all within ``timeout_s``: the socket is rebuilt and every group still in flight is
        resent, same bytes (the broker de-duplicates). ``TimeoutError`` after ``give_up_s`` or when
        ``should_stop()``; groups not in the returned dict may or may not be in Redis, and resending
        them is safe. A ``rejected`` ack with an empty group id (a payload the broker could not read
        an id from) belongs to the group in flight when there is only one; with several it cannot be
        matched and raises ``ValueError``."""
        ids = [gid for gid, _ in items]
        if len(set(ids)) != len(ids) or (len(ids) > 1 and not all(ids)):
            raise ValueError("send_many needs distinct group ids, non-empty when there are several")
        todo = deque(items)
        inflight: dict[str, bytes] = {}
        done: dict[str, Ack] = {}
        deadline = time.monotonic() + give_up_s
        busy, pause_until = Backoff(self.busy_wait_s, 1.0, factor=1.5), 0.0
        while todo or inflight:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(
                    f"broker {self.address} did not accept {len(todo) + len(inflight)} groups in {give_up_s}s"
                )
            if now >= pause_until:
                while todo and len(inflight) < window:
                    gid, payload = todo.popleft()
                    self.sock.send_multipart([b"", payload])
                    inflight[gid] = payload
            if not inflight:  # all waiting out a busy back-off
                if should_stop():
                    raise TimeoutError("stopping while the broker is busy")
                time.sleep(max(0.0, pause_until - now))
                continue
            try:  # an ack already waiting (the broker acknowledges a batch at a time): no poll for it
                _, reply = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if not self.sock.poll(int(self.timeout_s * 1000)):
                    if should_stop():
                        raise TimeoutError(
                            f"stopping before broker {self.address} acknowledged {len(inflight)} groups"
                        ) from None
                    log.warning(
                        "no ack from broker %s in %.1fs; resending group(s) %s (if this goes on: does "
                        "ingest_auth match the broker's, and is this producer's key in its allow-list?)",
                        self.address,
                        self.timeout_s,
                        ", ".join(list(inflight)[:4]) + (f" and {len(inflight) - 4} more" if len(inflight) > 4 else ""),
                    )
                    self.resends += len(inflight)
                    self._connect()
                    todo.extendleft(reversed(list(inflight.items())))
                    inflight.clear()
                    continue
                _, reply = self.sock.recv_multipart()
            try:
                ack = decode_ack(reply)
            except ProtocolError as e:
                log.error("broker sent an unreadable ack (%s); the groups in flight are resent on timeout", e)
                continue
            gid = ack.group_id
            if gid not in inflight and ack.status == "rejected" and not gid and len(inflight) == 1:
                gid = next(iter(inflight))  # the only group in flight: the unreadable one is ours
            if gid not in inflight:
                if ack.status == "rejected" and not gid:
                    raise ValueError(
                        f"the broker rejected a message whose group id it could not read "
                        f"({ack.reason}); send it alone with send()"
                    )
                log.warning("ack for a group not in flight %s (stale reply); ignored", gid)
                continue
            payload = inflight.pop(gid)
            if ack.status == "busy":
                self.busy_waits += 1
                on_busy()
                if should_stop():
                    raise TimeoutError("stopping while the broker is busy")
                todo.appendleft((gid, payload))
                pause_until = time.monotonic() + busy.next()
                continue
            busy.reset()
            done[gid] = ack
        return done

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
