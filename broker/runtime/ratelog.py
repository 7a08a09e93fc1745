"""A log line that an outsider can trigger at will, written at a bounded rate.

The ingest logs each CURVE handshake it refuses (the key, so an operator can tell a misconfigured producer
from a stranger), and anyone who knows the broker's public key can make it refuse thousands a second: one
line each filled the log (562 KB in 10 s). :class:`RateLimitedLog` writes the first ``burst`` lines of
each ``interval_s`` in full and only counts the rest; at the end of an interval in which lines were held
back, one summary line says how many, about how many distinct subjects (keys) they came from, and the
last one. Whatever counts the events (a Prometheus counter) still counts every one.

Thread-safe: the ingest's ZAP handler runs on the authenticator's thread. The summary is written by a
timer started when the first line of an interval is held back (at most one timer at a time), so it comes
even when the flood stops.
"""

from __future__ import annotations

import logging
import threading
import time

DISTINCT_MAX = 1024  # subjects remembered per interval for the summary's count ("at least" beyond it)


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        interval_s: float = 10.0,
        burst: int = 5,
        level: int = logging.WARNING,
        clock=time.monotonic,
    ):
        self.logger, self.what, self.level = logger, what, level
        self.interval_s, self.burst, self.clock = interval_s, burst, clock
        self._lock = threading.Lock()
        self._start = float("-inf")  # when the current interval began
        self._logged = 0
        self._held = 0
        self._subjects: set[str] = set()
        self._last = ""
        self._timer: threading.Timer | None = None

    def log(self, subject: str, msg: str, *args) -> None:
        """Log ``msg % args`` about ``subject`` (e.g. a key) unless this interval already had ``burst`` lines."""
        with self._lock:
            now = self.clock()
            if now - self._start >= self.interval_s:
                self._summarise()
                self._start, self._logged = now, 0
            if self._logged < self.burst:
                self._logged += 1
                write = True
            else:
                write = False
                self._held += 1
                if len(self._subjects) < DISTINCT_MAX:
                    self._subjects.add(subject)
                self._last = subject
                if self._timer is None:
                    self._timer = threading.Timer(max(0.0, self._start + self.interval_s - now), self.flush)
                    self._timer.daemon = True
                    self._timer.start()
        if write:
            self.logger.log(self.level, msg, *args)

    def flush(self) -> None:
        """Write the summary of the lines held back so far, if any (the timer calls it at the interval's end)."""
        with self._lock:
            self._timer = None
            self._summarise()

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._summarise()

    def _summarise(self) -> None:  # under the lock
        if not self._held:
            return
        n = len(self._subjects)
        distinct = f"at least {n}" if n >= DISTINCT_MAX else str(n)
        self.logger.log(
            self.level,
            "%d more %s in the last %g s, not logged one by one (from %s distinct, the last %s)",
            self._held,
            self.what,
            self.interval_s,
            distinct,
            self._last,
        )
        self._held, self._subjects, self._last = 0, set(), ""
