"""Redis connections: every service reaches the run's Redis through :func:`connect_redis`, and rides
out an outage with :class:`Backoff` (exponential, capped), never by swallowing the error."""

from __future__ import annotations

import logging
import time

import redis

log = logging.getLogger(__name__)


def connect_redis(url: str, wait_s: float = 30.0) -> redis.Redis:
    """A Redis client for ``url`` (``redis://host:port/db`` or ``unix:///path.sock``), waiting with
    back-off up to ``wait_s`` for the server to answer."""
    r = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5, health_check_interval=30)
    deadline = time.monotonic() + wait_s
    delay = 0.05
    while True:
        try:
            r.ping()
            return r
        except redis.ConnectionError as e:
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach Redis at {url}: {e}") from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
