"""The prompts a generator holds, and their renewal while it holds them.

A claimed prompt (training or held-out) stays pending in its stream until the generator releases it,
once its work is safe in Redis. A prompt pending for ``claim_idle_s`` is taken over by the next
generator that claims (``queues.claim_abandoned``): that is how a dead generator's prompts are
generated after all. A live generator whose batch runs longer than that (a large model, long
completions, a reward outage held by the sink) must keep its prompts, or each is generated twice and
admission control, which counts one group per admitted prompt, lets the generators run further ahead
than its bound (and the learner drops what comes out stale). So the generator renews what it holds
every ``claim_idle_s / 3`` with its heartbeats (from the engine's steps, the compute watch and the sink,
so a long engine step renews too); a stopped or hung generator does not, and loses its prompts as before.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from broker.client import queues

log = logging.getLogger("relay.generator.leases")


class Leases:
    def __init__(self, r: redis.Redis, consumer: str, idle_s: float):
        self.r, self.consumer, self.every_s = r, consumer, idle_s / 3
        self._held: dict[str, set[bytes]] = {}  # stream -> entry ids claimed and not yet released
        self._lock = threading.Lock()
        self._renewing = threading.Lock()  # one renewal at a time (heartbeats come from several threads)
        self._last = time.monotonic()
        self.lost = 0  # held entries another generator had taken over when this one came to renew them

    def hold(self, stream: str, eids: list[bytes]) -> None:
        with self._lock:
            self._held.setdefault(stream, set()).update(eids)

    def release(self, stream: str, eid: bytes) -> None:
        with self._lock:
            self._held.get(stream, set()).discard(eid)

    def held(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._held.values())

    def renew(self) -> None:
        """Renew every held prompt, at most every ``claim_idle_s / 3``; cheap when it is not time."""
        if time.monotonic() - self._last < self.every_s or not self._renewing.acquire(blocking=False):
            return
        try:
            self._last = time.monotonic()
            with self._lock:
                held = {stream: list(eids) for stream, eids in self._held.items() if eids}
            for stream, eids in held.items():
                kept = queues.renew_claims(self.r, stream, self.consumer, eids)
                # released meanwhile (the sink's thread), or taken over while this generator was stopped
                # for longer than claim_idle_s: the other generator answers it now
                with self._lock:
                    gone = [e for e in eids if e not in kept and e in self._held.get(stream, ())]
                    self._held.get(stream, set()).difference_update(gone)
                if gone:
                    self.lost += len(gone)
                    log.warning(
                        "%d prompt(s) of %s were taken over by another generator (this one was stopped or "
                        "hung for longer than claim_idle_s); its groups for them are duplicates",
                        len(gone),
                        stream,
                    )
        finally:
            self._renewing.release()
