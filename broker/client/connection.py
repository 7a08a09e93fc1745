"""Connections: every service reaches the run's Redis through :func:`connect_redis`; every retry
loop (Redis, the reward service, the broker's ``busy``, restarts) waits with :class:`Backoff`
(exponential, capped), never by swallowing the error; :func:`connect_address` turns the address a
server binds into one its clients can connect to; :func:`redact_url` is how a URL is printed (its
password is a secret)."""

from __future__ import annotations

import logging
import socket
import time
from urllib.parse import urlsplit, urlunsplit

import redis

log = logging.getLogger(__name__)


class Backoff:
    """Delays of a retry loop: ``first_s``, then ``factor`` times the previous one, at most ``cap_s``.

    ``next()`` returns the delay before the next attempt and counts it; ``sleep()`` waits it out;
    ``reset()`` starts over (after a success); ``delay(n)`` is the n-th delay (1, 2, ...) without
    counting, for callers that keep their own attempt number (with jitter, or async sleeps)."""

    def __init__(self, first_s: float, cap_s: float, factor: float = 2.0):
        self.first_s, self.cap_s, self.factor = first_s, cap_s, factor
        self.attempts = 0

    def delay(self, attempt: int) -> float:
        # grown step by step up to the cap: factor ** attempt would overflow a float after ~1,000 attempts
        # (a producer told `busy` for half an hour, a service retrying Redis for hours)
        d = self.first_s
        if self.factor > 1:
            for _ in range(max(0, attempt - 1)):
                d *= self.factor
                if d >= self.cap_s:
                    break
        return min(d, self.cap_s)

    def next(self) -> float:
        self.attempts += 1
        return self.delay(self.attempts)

    def sleep(self) -> None:
        time.sleep(self.next())

    def reset(self) -> None:
        self.attempts = 0

    @property
    def at_cap(self) -> bool:
        """The next delay is the longest one."""
        return self.delay(self.attempts + 1) >= self.cap_s


def redact_url(url: str) -> str:
    """``url`` as it may be printed: its password replaced by ``***`` (``redis://learner:***@host:6379/0``);
    a URL without one is returned as it is."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not parseable as a URL: show nothing of it that could be a secret
        return "<a URL that cannot be parsed>"
    if password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def connect_redis(url: str, wait_s: float = 30.0) -> redis.Redis:
    """A Redis client for ``url`` (``redis://[user:password@]host:port/db``, ``rediss://`` for TLS,
    or ``unix:///path.sock``), waiting with back-off (0.05 s doubling to 1 s) up to ``wait_s`` for the
    server to answer. A refused password fails at once (no retry)."""
    r = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5, health_check_interval=30)
    deadline = time.monotonic() + wait_s
    backoff = Backoff(0.05, 1.0)
    while True:
        try:
            r.ping()
            return r
        except redis.AuthenticationError as e:
            raise ConnectionError(f"Redis at {redact_url(url)} refused the credentials: {e}") from None
        except redis.ConnectionError as e:
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach Redis at {redact_url(url)}: {e}") from None
            backoff.sleep()


WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


def connect_host(bind_host: str, wildcard_host: str | None = None) -> str:
    """The host to reach a server bound on ``bind_host``: itself, or for a wildcard (every
    interface) ``wildcard_host`` (default: this machine's name, for clients on other machines)."""
    return (wildcard_host or socket.gethostname()) if bind_host in WILDCARD_HOSTS else bind_host


def worker_addresses(address: str, workers: int) -> list[str]:
    """The addresses of ``workers`` broker ingest workers whose first is ``address`` (``tcp://host:port``):
    worker k at ``port + k`` (broker.ingest_workers, docs/protocol.md 5.1)."""
    if workers == 1:
        return [address]
    scheme, _, rest = address.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not port.isdigit():
        raise ValueError(f"{address!r}: several ingest workers need a tcp://host:port address (worker k at port + k)")
    return [f"tcp://{host}:{int(port) + k}" for k in range(workers)]


def split_addresses(addresses: str) -> list[str]:
    """A comma-separated list of ZeroMQ addresses (a generator's ``broker_address``), spaces ignored."""
    return [a.strip() for a in addresses.split(",") if a.strip()]


def connect_address(bind: str, wildcard_host: str | None = None) -> str:
    """The ZeroMQ address to connect to a socket bound at ``bind``: the same, with a wildcard host
    (``tcp://*:5555``, ``tcp://0.0.0.0:5555``) replaced as :func:`connect_host` does."""
    scheme, _, rest = bind.partition("://")
    host, sep, port = rest.rpartition(":")
    return f"tcp://{connect_host(host, wildcard_host)}:{port}" if scheme == "tcp" and sep else bind
