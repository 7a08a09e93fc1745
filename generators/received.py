"""Versions a generator receives in process (the ``collective`` and ``ipc`` transports): applied as they
arrive, before their announcement exists, then checked against it.

A receiver (generators/weight_receive.py, generators/ipc_receive.py) delivers each version's tensors with
the digest it computed from the bytes received; :class:`ReceivedVersions` applies the newest into the
engine (``update_weights_from_tensors``), refuses what arrived with a bad digest or signature (shown and
counted as a bad snapshot is), and once the version's signed announcement exists compares the two: a
version announced with another digest than the one applied is refused and the generator goes back to
the store copy. The groups of a version applied before its announcement get their ``weight_hash`` from
:meth:`ReceivedVersions.hash_for` when they are sent.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from broker.client.announcements import signed_announcement
from broker.client.telemetry import emit_event

if TYPE_CHECKING:
    from generators.weights import WeightApplier

log = logging.getLogger("relay.generator.weights")


class ReceivedVersions:
    """The in-process side of a :class:`~generators.weights.WeightApplier` (``w``): it sets the version ``w``
    serves when it applies one. ``receiver`` None (another transport): nothing arrives, and
    :meth:`hash_for` reads announcements only."""

    def __init__(self, w: WeightApplier, receiver=None):
        self.w, self.receiver = w, receiver
        self.unconfirmed: dict[int, str] = {}  # version applied in process -> digest, until its announcement
        self.updates = 0  # versions applied from the receiver
        self.last_receive_s: float | None = None  # how long the receiver took to receive and check the last one
        self.applied_digests: dict[int, str] = {}  # version -> digest of what was applied in process

    def apply_newest(self) -> None:
        """Apply the newest version received over the collective, if newer than the one served; refuse
        and flag what arrived with a bad digest or signature; check applied versions against their
        announcements as these arrive."""
        for bad in self.receiver.take_rejected():
            self.refuse(bad.version, bad.problem, bad.digest)
        got = self.receiver.take(self.w.version)
        if got is not None:
            self.w.report("updating", False)
            try:
                # the engine may take the staging buffer itself (the torch backend, same dtype): no copy
                adopted = bool(self.w.backend.update_weights_from_tensors(got.state, adopt=True))
                failed = None
            except (ValueError, RuntimeError) as e:
                failed, adopted = e, False
            self.receiver.recycle(got, adopted)  # a buffer the engine no longer uses takes the next version
            if failed is not None:
                self.refuse(got.version, f"apply_failed: {failed}", got.digest)
            else:
                self.w.version, self.w.digest, self.w.via = got.version, got.digest, self.receiver.via
                self.w.hash = ""  # the manifest hash of its files: known from the announcement (below)
                self.unconfirmed[got.version] = got.digest
                self.applied_digests[got.version] = got.digest
                for old in [v for v in self.applied_digests if v < got.version - 1000]:
                    del self.applied_digests[old]
                self.w.updates += 1
                self.updates += 1
                latency = time.time() - got.received_at + got.seconds
                self.last_receive_s = got.seconds
                self.w.last_update_latency_s = round(latency, 4)
                emit_event(
                    self.w.r,
                    self.w.keys,
                    "applied",
                    generator=self.w.generator_id,
                    version=got.version,
                    latency_s=latency,
                    digest=got.digest,
                    via=self.receiver.via,
                )
                log.info("serving version %d (digest %s) via %s", got.version, got.digest[:12], self.receiver.via)
                self.w.report("sampling", True)
        self.confirm()

    def confirm(self) -> None:
        """Compare each version applied via the collective with its signed announcement once that exists."""
        for v, digest in list(self.unconfirmed.items()):
            a = signed_announcement(self.w.r, self.w.keys, v, self.w.announce_key)  # a forged entry reads as none yet
            if a is None:
                if len(self.unconfirmed) > 64:  # never announced (the learner died after the broadcast)
                    del self.unconfirmed[v]
                continue
            del self.unconfirmed[v]
            if not a.digest or a.digest == digest:
                if v == self.w.version:
                    self.w.hash = a.hash
                continue
            self.refuse(v, "announced_digest_mismatch", digest)
            if v == self.w.version:
                self.w.version = v - 1  # what we serve is not what was announced: load the store copy now

    def hash_for(self, version: int, wait_s: float = 30.0) -> str:
        """The manifest hash announced for ``version`` (what the broker checks a group's ``weight_hash``
        against). A version applied via the collective is served before its announcement exists: this
        waits for the announcement (at most ``wait_s``; "" then, and the broker rejects the group, counted).
        Called from the sink's thread, so generation never waits for it, and (``wait_s=0``) for heartbeats.
        Reads only: safe from any thread."""
        if version == self.w.version and self.w.hash:
            return self.w.hash
        deadline = time.monotonic() + wait_s
        while True:
            a = signed_announcement(self.w.r, self.w.keys, version, self.w.announce_key)
            if a is not None:
                applied = self.applied_digests.get(version)
                # a digest other than the one applied: flagged by confirm; its groups must not pass
                return a.hash if not (a.digest and applied and a.digest != applied) else ""
            if time.monotonic() >= deadline or self.w.stopped():
                if wait_s > 0:
                    log.error(
                        "version %d was applied via the collective but not announced within %.0fs", version, wait_s
                    )
                return ""
            time.sleep(0.02)

    def refuse(self, version: int, reason: str, digest: str) -> None:
        """A version from the collective that is not served: flagged as a bad snapshot is (shown, counted,
        a ``refused`` event); the previous version keeps serving, later ones still arrive."""
        reason = reason.splitlines()[0][:200]
        self.w.refusals.received(f"{self.receiver.via}:v{version}:{digest[:12]}", reason)
        log.error(
            "refused weight version %d received via %s (%s); still serving version %s",
            version,
            self.receiver.via,
            reason,
            self.w.version,
        )
        emit_event(
            self.w.r,
            self.w.keys,
            "refused",
            generator=self.w.generator_id,
            version=version,
            reason=reason,
            via=self.receiver.via,
            digest=digest,
        )
