"""A Redis transaction sent now and read later, on one connection of its own: the broker's ingest
writes batch k and validates batch k+1 while Redis runs batch k, in one thread (no writer thread: no
GIL hand-over and no wake-up per batch, which on a machine of two cores cost as much as the Redis
call itself; docs/benchmarks.md "ingest").

:class:`OverlappedTransactions` takes the commands a ``redis.Redis.pipeline()`` has queued (MULTI/EXEC
around them, as ``Pipeline.execute`` sends them), writes them with one ``sendmsg`` (a group's message
stays a view: nothing is joined), and later reads the replies. At most one transaction is in flight.
A connection error disconnects the connection (the next transaction opens a new one) and is raised:
nothing of a transaction whose replies were not read may be acknowledged; the caller's producers
resend and the de-duplication answers what did get in.
"""

from __future__ import annotations

import socket

import redis
from redis.exceptions import ExecAbortError, ResponseError


class OverlappedTransactions:
    def __init__(self, r: redis.Redis):
        self.r = r
        self._conn = None
        self._pending = 0  # commands of the transaction in flight (0: none)

    @property
    def in_flight(self) -> bool:
        return self._pending > 0

    def send(self, pipe: redis.client.Pipeline) -> None:
        """Write ``pipe``'s commands as one MULTI/EXEC transaction without waiting for its replies."""
        if self._pending:
            raise RuntimeError("a transaction is already in flight: read its replies first")
        commands = [args for args, _ in pipe.command_stack]
        if not commands:
            raise ValueError("an empty transaction")
        conn = self._connection()
        chunks = conn.pack_commands([("MULTI",), *commands, ("EXEC",)])
        try:
            sock = conn._sock  # redis-py's socket; a TLS one cannot sendmsg
            if type(sock) is socket.socket:
                _sendmsg_all(sock, chunks)
            else:
                conn.send_packed_command(chunks, check_health=False)
        except (OSError, redis.ConnectionError, redis.TimeoutError) as e:
            self._drop()
            raise redis.ConnectionError(f"writing a transaction to Redis: {e}") from e
        self._pending = len(commands)

    def results(self) -> list:
        """The replies of the transaction in flight, one per command (raw: no response callbacks). The first
        error (a command refused when queued, or one failing inside EXEC) is raised, as
        ``Pipeline.execute`` raises it; a connection error disconnects first."""
        n, self._pending = self._pending, 0
        if not n:
            raise RuntimeError("no transaction in flight")
        conn = self._conn
        errors = []
        try:
            for i in range(n + 1):  # MULTI's +OK, then +QUEUED per command (or its error)
                try:
                    conn.read_response()
                except ResponseError as e:
                    errors.append(e)
            try:
                replies = conn.read_response()
            except ExecAbortError:
                raise errors[0] if errors else redis.ResponseError("EXECABORT without an error") from None
        except (OSError, redis.ConnectionError, redis.TimeoutError) as e:
            self._drop()
            raise redis.ConnectionError(f"reading a transaction's replies from Redis: {e}") from e
        if errors:
            raise errors[0]
        if not isinstance(replies, list) or len(replies) != n:
            self._drop()
            raise redis.ResponseError(f"a transaction of {n} commands got {replies!r:.80} from EXEC")
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def close(self) -> None:
        """Give the connection back (disconnected when a transaction's replies were never read)."""
        if self._pending:
            self._drop()
        elif self._conn is not None:
            self.r.connection_pool.release(self._conn)
            self._conn = None

    def _connection(self):
        if self._conn is None:
            self._conn = self.r.connection_pool.get_connection()
        return self._conn

    def _drop(self) -> None:
        self._pending = 0
        if self._conn is not None:
            self._conn.disconnect()
            self.r.connection_pool.release(self._conn)
            self._conn = None


def _sendmsg_all(sock: socket.socket, chunks: list) -> None:
    """Every byte of ``chunks`` through ``sock``, in as few ``sendmsg`` calls as the socket takes."""
    views = [memoryview(c).cast("B") for c in chunks]
    while views:
        sent = sock.sendmsg(views[:1024])  # IOV_MAX
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0
