"""A bounded HTTP/1.0 server for the broker's dashboard and the services' ``/metrics``: a fixed pool of
worker threads, a cap on open connections, and a deadline on reading each request's head.

``http.server.ThreadingHTTPServer`` starts a thread per connection and waits for the request line
with no timeout: a client that opens connections and sends nothing (or one byte at a time: a
slowloris) holds threads forever. Here one selector thread accepts connections and reads their
request heads without blocking; only a complete head (``\\r\\n\\r\\n`` within ``max_head_bytes``,
read within ``head_timeout_s``) goes to a worker, which runs the ordinary ``BaseHTTPRequestHandler``
on it. A connection still reading its head when ``max_connections`` are open is closed to make
room (the oldest first), so a flood of idle connections cannot keep a real request (``/healthz``)
out; a head too slow, too large or with a body is answered 408, 431 or 413 and closed. When every
worker is busy, a complete request waits for one (at most ``max_connections`` wait); long-lived
responses (server-sent events) are the handler's to cap (see ``stream_slots``).

Counted, for the owner's ``/metrics``: ``refused`` by reason (``head_timeout``, ``head_too_large``,
``body``, ``evicted``).
"""

from __future__ import annotations

import io
import logging
import selectors
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler

from broker.runtime.ports import handed_over

log = logging.getLogger("relay.http")

_REPLIES = {
    "head_timeout": b"HTTP/1.0 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    "head_too_large": b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    "body": b"HTTP/1.0 413 Content Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
}


class _Pending:
    """A connection whose request head is still arriving."""

    __slots__ = ("sock", "addr", "buf", "deadline")

    def __init__(self, sock: socket.socket, addr, deadline: float):
        self.sock, self.addr, self.buf, self.deadline = sock, addr, bytearray(), deadline


class BoundedHTTPServer:
    """Serves ``handler`` (a ``BaseHTTPRequestHandler`` subclass; GET and HEAD only: a request with a
    body is refused) on ``address``; ``port`` 0 picks a free one (``server_address``). Call
    :meth:`start`, then :meth:`shutdown` and :meth:`server_close`."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        workers: int = 8,
        max_connections: int = 256,
        head_timeout_s: float = 5.0,
        max_head_bytes: int = 16384,
        write_timeout_s: float = 30.0,
        stream_slots: int | None = None,
    ):
        self.handler = handler
        self.workers, self.max_connections = workers, max_connections
        self.head_timeout_s, self.max_head_bytes, self.write_timeout_s = head_timeout_s, max_head_bytes, write_timeout_s
        # long-lived responses (the dashboard's event stream) may hold at most this many workers
        self.stream_slots = threading.BoundedSemaphore(
            stream_slots if stream_slots is not None else max(1, workers // 2)
        )
        self.refused: Counter = Counter()
        # the socket its launcher bound for it (relay up holds every port it hands out: broker/runtime/ports.py)
        self.socket = handed_over(*address[:2]) or socket.create_server(address, backlog=128)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()[:2]
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="http")
        self._queued = threading.BoundedSemaphore(max_connections)  # requests handed to the pool, not done
        self._pending: dict[int, _Pending] = {}  # fileno -> connection reading its head (oldest first)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the selector thread ----------------------------------------------------------------------

    def start(self, name: str = "http") -> None:
        self._thread = threading.Thread(target=self.serve_forever, name=name, daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                if key.fileobj is self.socket:
                    self._accept()
                else:
                    self._read(key.fileobj)
            self._expire()

    def _accept(self) -> None:
        try:
            sock, addr = self.socket.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(self._pending) >= self.max_connections:
            self._drop(next(iter(self._pending.values())), "evicted")  # the oldest head still arriving
        sock.setblocking(False)
        self._pending[sock.fileno()] = _Pending(sock, addr, time.monotonic() + self.head_timeout_s)
        self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        conn = self._pending.get(sock.fileno())
        if conn is None:
            return
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away before sending a whole head
            self._forget(conn)
            conn.sock.close()
            return
        conn.buf += data
        end = conn.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.buf) > self.max_head_bytes:
                self._drop(conn, "head_too_large")
            return
        if end > self.max_head_bytes:
            self._drop(conn, "head_too_large")
            return
        head = bytes(conn.buf[: end + 4])
        if _has_body(head) or len(conn.buf) > end + 4:
            self._drop(conn, "body")
            return
        self._forget(conn)
        if not self._queued.acquire(blocking=False):  # more requests waiting for a worker than connections allowed
            self._refuse(conn, "busy")
            return
        try:
            self._pool.submit(self._handle, conn.sock, conn.addr, head)
        except RuntimeError:  # the pool takes no more work: the server or the interpreter is shutting down
            self._queued.release()
            self._refuse(conn, "shutting_down")
            self._stop.set()

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._pending.values() if c.deadline <= now]:
            self._drop(conn, "head_timeout")

    def _forget(self, conn: _Pending) -> None:
        self._pending.pop(conn.sock.fileno(), None)
        self._selector.unregister(conn.sock)

    def _drop(self, conn: _Pending, reason: str) -> None:
        self._forget(conn)
        self._refuse(conn, reason)

    def _refuse(self, conn: _Pending, reason: str) -> None:
        self.refused[reason] += 1
        reply = _REPLIES.get(reason, b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        try:
            if reason != "evicted":
                conn.sock.send(reply)  # non-blocking: a client that reads nothing gets nothing
        except OSError:
            pass  # the client is already gone; the refusal is counted above
        conn.sock.close()

    # -- workers ------------------------------------------------------------------------------------

    def _handle(self, sock: socket.socket, addr, head: bytes) -> None:
        try:
            sock.setblocking(True)
            sock.settimeout(self.write_timeout_s)  # a client that stops reading frees the worker
            self.handler(_Request(sock, head), addr, self)
        except OSError as e:
            log.debug("http: %s went away: %s", addr, e)
        finally:
            self._queued.release()
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the client
            sock.close()

    # -- lifecycle ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def server_close(self) -> None:
        for conn in list(self._pending.values()):
            self._forget(conn)
            conn.sock.close()
        self._selector.close()
        self.socket.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _has_body(head: bytes) -> bool:
    """Whether the request announces a body (the servers here take none)."""
    for line in head.lower().split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip() == b"transfer-encoding" or (
            name.strip() == b"content-length" and value.strip() not in (b"", b"0")
        ):
            return True
    return False


class _Request:
    """The socket as ``BaseHTTPRequestHandler`` sees it: the head already read comes first."""

    def __init__(self, sock: socket.socket, head: bytes):
        self.sock, self.head = sock, head

    def makefile(self, mode: str, *args, **kwargs):
        if "r" in mode:
            return io.BufferedReader(io.BytesIO(self.head))
        return self.sock.makefile(mode, *args, **kwargs)

    def __getattr__(self, name: str):  # sendall, settimeout, setsockopt, ...: the socket's own
        return getattr(self.sock, name)
