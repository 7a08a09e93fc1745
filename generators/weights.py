"""Where a generator applies announced weight versions: in place, in its running engine.

Before a batch (and, with the in-flight policy ``continue``, between decode steps) the generator
asks for the latest announcement; a newer version is verified file by file against its manifest
(broker/protocol/weightstore.py), then loaded into the engine the backend already runs
(``Backend.update_weights``; the first version with ``Backend.load``). A snapshot that fails is
refused: its hash is remembered (never retried), counted, reported in the heartbeat and as a
``refused`` event, and the previous version keeps serving. A version superseded (and perhaps
pruned) while it was being read is not a bad snapshot: the newer one is loaded instead.

Provenance: when the announcement carries the digest of the published tensors, the same single read
that checks each file's sha256 computes the digest of the tensors the files hold
(``weightstore.check``); a digest other than the announced one (a weight file altered and its
manifest recomputed) is refused as ``digest_mismatch``, like a bad hash. The ``applied`` event
carries the digest of what was applied (docs/weights.md).

An announcement the run's key did not sign (written into Redis by someone else) is never loaded: it
is logged, counted (``forged_announcements``, in the heartbeat and /metrics), reported as a
``refused`` event, and the generator keeps serving its version. With ``store`` set, a version
outside the weight store is refused as well (broker/protocol/weightstore.py ``check_in_store``).
With ``weights.transport = "http"`` a version is first fetched from the learner's weight server into the
generator's own cache (generators/weight_fetch.py), then verified and loaded from there the same way.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import redis

from broker.client.announcements import ForgedAnnouncement, checked_latest, newest_signed
from broker.client.telemetry import emit_event
from broker.protocol import weightstore
from broker.protocol.keys import Keys
from generators.backends.base import Backend

log = logging.getLogger("relay.generator.weights")


class WeightApplier:
    """The version a generator serves, and how it changes.

    ``report(state, heartbeat)`` tells the generator what it is doing (``waiting_for_weights``,
    ``updating``, ``sampling``) and whether to send a heartbeat now."""

    def __init__(self, r: redis.Redis, keys: Keys, backend: Backend, generator_id: str,
                 report: Callable[[str, bool], None] = lambda state, heartbeat: None,
                 stopped: Callable[[], bool] = lambda: False, announce_key: bytes | None = None,
                 store: str = "", fetcher=None):
        self.r, self.keys, self.backend, self.generator_id = r, keys, backend, generator_id
        self.announce_key = announce_key  # None: announcements are not checked (announce_auth insecure)
        self.store = store or None  # the weight store every version must be in (None: anywhere)
        self.fetcher = fetcher  # weights.transport http: generators/weight_fetch.py WeightFetcher (None: store)
        self.forged_announcements = 0  # distinct announcements seen whose signature is missing or wrong
        self._forged_seen: set[tuple[str, str]] = set()
        self.report, self.stopped = report, stopped
        self.version: int | None = None  # the version served (None before the first load)
        self.hash = ""
        self.digest = ""  # the tensor digest of the version served ("" when its announcement had none)
        self.refused: dict[str, str] = {}  # hash -> reason: snapshots refused and forged announcements (shown)
        self.bad: set[str] = set()  # hashes of snapshots that failed verification: never retried
        self.updates = 0
        self.refused_updates = 0
        self.last_update_latency_s: float | None = None

    def update(self, block: bool = False) -> None:
        """Apply the latest announced version if it is newer than the one served. ``block``: wait
        (every 0.2 s) until a first version is announced."""
        while True:
            a = self._latest()
            if a is not None or not block or self.stopped():
                break
            self.report("waiting_for_weights", True)
            time.sleep(0.2)
        while a is not None and (self.version is None or a.version > self.version) and a.hash not in self.bad:
            self.report("updating", False)
            try:
                path, root = (self.fetcher.fetch(a, self.version), self.fetcher.cache) if self.fetcher \
                    else (a.path, self.store)
                checked = weightstore.check(path, a.hash, root, expected_digest=a.digest or None)
                if self.version is None:
                    self.backend.load(str(path))
                else:
                    self.backend.update_weights(str(path))
                break
            except (weightstore.WeightStoreError, ValueError, OSError) as e:
                newer = self._latest()
                if newer is not None and newer.version > a.version:
                    # superseded while we read it (and perhaps pruned): not a bad snapshot
                    log.warning("version %d was superseded while loading (%s); loading version %d instead",
                                a.version, e, newer.version)
                    a = newer
                    continue
                self._refuse(a, e)
                return
        else:
            return
        latency = time.time() - a.published_at
        self.version, self.hash, self.digest = a.version, a.hash, checked.digest or ""
        self.updates += 1
        self.last_update_latency_s = round(latency, 4)
        emit_event(self.r, self.keys, "applied", generator=self.generator_id, version=a.version, latency_s=latency,
                   digest=self.digest)
        log.info("serving version %d (%s) %.3fs after publication", a.version, a.hash[:12], latency)
        self.report("sampling", True)  # the update is done; sampling resumes right after (the heartbeat says so)

    def _latest(self):
        """The latest announcement signed by the run's key (None before the first). A forged one in
        ``latest`` is logged, counted once and reported; the newest signed version stands instead."""
        try:
            return checked_latest(self.r, self.keys, self.announce_key)
        except ForgedAnnouncement as e:
            a = e.announcement
            if (a.hash, a.sig) not in self._forged_seen:
                self._forged_seen.add((a.hash, a.sig))
                self.forged_announcements += 1
                self.refused[a.hash] = e.reason  # shown only: a signed announcement of that hash still loads
                log.error("ignored a forged weight announcement (%s): version %d, hash %s, path %s; still serving "
                          "version %s", e.reason, a.version, a.hash[:12], a.path, self.version)
                emit_event(self.r, self.keys, "refused", generator=self.generator_id, version=a.version,
                           reason=e.reason)
            return newest_signed(self.r, self.keys, self.announce_key)

    def _refuse(self, a, e: Exception) -> None:
        reason = getattr(e, "reason", type(e).__name__)
        self.refused[a.hash] = reason
        self.bad.add(a.hash)
        self.refused_updates += 1
        log.error("refused weight version %d (%s): %s; still serving version %s", a.version, reason, e, self.version)
        emit_event(self.r, self.keys, "refused", generator=self.generator_id, version=a.version, reason=reason)
        if self.version is None:
            raise RuntimeError(f"cannot load the initial weights: {e}") from e
