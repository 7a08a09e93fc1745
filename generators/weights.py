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

LoRA adapters published alone (learner.lora.publish): a version whose announcement pins a base
(``Announcement.base``, ``base_digest``) is applied onto the base model the generator serves, only
when that base's digest is the pinned one; a generator starting fresh loads the base from the version
that carries it first. An adapter for another base is refused (``base_mismatch``), shown red like a
bad hash: the generator never serves its base model in the adapted policy's place.

An announcement the learner's private key did not sign (written into Redis by someone else, or signed
with any other key: a generator holds only the public one) is never loaded: it
is logged, counted (``forged_announcements``, in the heartbeat and /metrics), reported as a
``refused`` event, and the generator keeps serving its version. With ``store`` set, a version
outside the weight store is refused as well (broker/protocol/weightstore.py ``check_in_store``).
With ``weights.transport = "http"`` a version is first fetched from the learner's weight server into the
generator's own cache (generators/weight_fetch.py), then verified and loaded from there the same way.

Check then load is one read, for every load of an engine that takes what it is handed (the torch
backend): the files the check hashed are what the engine loads (:meth:`WeightApplier._obtain`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import redis

from broker.client.announcements import ForgedAnnouncement, checked_latest, newest_signed, signed_announcement
from broker.client.telemetry import emit_event
from broker.protocol import weightstore
from broker.protocol.keys import Keys
from broker.protocol.signing import AnnounceVerifier
from generators.backends.base import Backend

log = logging.getLogger("relay.generator.weights")


class WeightApplier:
    """The version a generator serves, and how it changes.

    ``report(state, heartbeat)`` tells the generator what it is doing (``waiting_for_weights``,
    ``updating``, ``sampling``) and whether to send a heartbeat now."""

    def __init__(self, r: redis.Redis, keys: Keys, backend: Backend, generator_id: str,
                 report: Callable[[str, bool], None] = lambda state, heartbeat: None,
                 stopped: Callable[[], bool] = lambda: False, announce_key: AnnounceVerifier | None = None,
                 store: str = "", fetcher=None, receiver=None, hash_threads: int = 1):
        self.r, self.keys, self.backend, self.generator_id = r, keys, backend, generator_id
        self.announce_key = announce_key  # None: announcements are not checked (announce_auth insecure)
        self.store = store or None  # the weight store every version must be in (None: anywhere)
        self.fetcher = fetcher  # weights.transport http: generators/weight_fetch.py WeightFetcher (None: store)
        self.hash_threads = hash_threads  # a version's files verified side by side (weights.hash_threads)
        self.forged_announcements = 0  # distinct announcements seen whose signature is missing or wrong
        self._forged_seen: set[tuple[str, str]] = set()
        self.report, self.stopped = report, stopped
        self.version: int | None = None  # the version served (None before the first load)
        self.hash = ""
        self.digest = ""  # the tensor digest of the version served ("" when its announcement had none)
        self.base_digest = ""  # LoRA adapters: the digest of the base model served under them ("" without)
        self.refused: dict[str, str] = {}  # hash -> reason: snapshots refused and forged announcements (shown)
        self.bad: set[str] = set()  # hashes of snapshots that failed verification: never retried
        self.updates = 0
        self.refused_updates = 0
        self.last_update_latency_s: float | None = None
        # the collective and ipc transports (generators/weight_receive.py, generators/ipc_receive.py): versions
        # that arrive before their announcement; None with the other transports
        self.receiver = receiver
        self.via = "store"  # how the version served arrived: store, http, collective or ipc
        self.unconfirmed: dict[int, str] = {}  # version applied via the collective -> digest, until its announcement
        self.collective_updates = 0  # versions applied from the receiver (collective or ipc)
        self.last_receive_s: float | None = None  # how long the receiver took to receive and check the last one
        self.applied_digests: dict[int, str] = {}  # version -> digest of what was applied via the collective

    def update(self, block: bool = False) -> None:
        """Apply the latest announced version if it is newer than the one served. ``block``: wait
        (every 0.2 s) until a first version is announced."""
        if self.receiver is not None and self.version is not None:
            self._from_collective()
        while True:
            a = self._latest()
            if a is not None or not block or self.stopped():
                break
            self.report("waiting_for_weights", True)
            time.sleep(0.2)
        if (a is not None and self.receiver is not None and self.version is not None and a.version > self.version
                and self.receiver.catch_up(a.version)):  # announced just before the receiver delivered it
            self._from_collective()
        while a is not None and (self.version is None or a.version > self.version) and a.hash not in self.bad:
            self.report("updating", False)
            try:
                path, digest, verified = self._obtain(a)
                try:
                    if a.adapter_only:  # a LoRA adapter alone: onto the base it pins (loaded first on a fresh start)
                        if self.version is None:
                            self._load_base(a)
                        elif self.base_digest != a.base_digest:
                            raise weightstore.WeightStoreError(
                                "base_mismatch", f"version {a.version} is an adapter for the base model "
                                f"{a.base_digest[:12] or '?'} (version {a.base}); this generator serves the base "
                                f"{self.base_digest[:12] or 'of a model without adapters'}")
                        self._engine("update_weights", path, verified)
                    else:
                        self._engine("load" if self.version is None else "update_weights", path, verified)
                finally:
                    if verified is not None:
                        verified.close()
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
        self.version, self.hash, self.digest = a.version, a.hash, digest or ""
        self.base_digest = a.base_digest if a.base is not None else ""
        self.via = "http" if self.fetcher else "store"
        self.updates += 1
        self.last_update_latency_s = round(latency, 4)
        emit_event(self.r, self.keys, "applied", generator=self.generator_id, version=a.version, latency_s=latency,
                   digest=self.digest, via=self.via)
        log.info("serving version %d (%s) %.3fs after publication", a.version, a.hash[:12], latency)
        self.report("sampling", True)  # the update is done; sampling resumes right after (the heartbeat says so)
        if self.receiver is not None:
            self.receiver.start()  # joins the broadcast once the engine runs (a no-op when started)

    def _engine(self, what: str, path, verified) -> None:
        """The backend's ``load`` or ``update_weights`` of version folder ``path``: from the bytes its check
        hashed when there are (``verified``), else by path (an engine that opens the files itself)."""
        fn = getattr(self.backend, what)
        if verified is not None:
            fn(str(path), verified=verified)
        else:
            fn(str(path))

    def _obtain(self, a):
        """(the local folder of version ``a``, the digest of its tensors, what its check kept or None), its
        files checked against the announced hash and digest: read in place from the store, or fetched over
        HTTP (the fetcher checked hash and digest as the bytes came). WeightStoreError otherwise.

        For an engine that loads what it is handed (the torch backend: ``loads_mapped_files``), every load
        (the first, each update, a LoRA adapter, its base) keeps what the check read: the safetensors files
        mapped, the other files' bytes (weightstore.check ``keep``; over HTTP, the files the fetcher wrote and
        hashed, mapped through the same open files). The engine loads the bytes that were hashed (a file
        renamed into the folder after the check is not loaded), and the files are read once."""
        keep = bool(getattr(self.backend, "loads_mapped_files", False))
        if self.fetcher is None:
            v = weightstore.check(a.path, a.hash, self.store, expected_digest=a.digest or None,
                                  threads=self.hash_threads, keep=keep)
            return a.path, v.digest, (v if keep else None)
        path, v = self.fetcher.fetch_kept(a, self.version, keep)
        digest = self.fetcher.digests.get(a.version)
        if a.digest and digest != a.digest:
            if v is not None:
                v.close()
            raise weightstore.WeightStoreError("digest_mismatch", f"{path}: the tensors' digest {(digest or '')[:12]} "
                                               f"differs from the announced {a.digest[:12]}")
        return path, digest, v

    def _load_base(self, a) -> None:
        """Start the engine from the version that carries the base model the adapter ``a`` pins (its signed
        announcement must say it carries that base). WeightStoreError ``missing_base`` otherwise."""
        b = signed_announcement(self.r, self.keys, a.base, self.announce_key)
        if b is None or b.base != b.version or b.base_digest != a.base_digest:
            found = "not announced" if b is None else f"announced with base {b.base} ({b.base_digest[:12]})"
            raise weightstore.WeightStoreError("missing_base", f"version {a.version} is an adapter for the base model "
                                               f"of version {a.base} ({a.base_digest[:12]}), which is {found}")
        path, _, verified = self._obtain(b)
        log.info("loading the base model from version %d for the adapter of version %d", b.version, a.version)
        try:
            self._engine("load", path, verified)
        finally:
            if verified is not None:
                verified.close()

    # -- the in-process transports (collective, ipc) ---------------------------------------------

    def _from_collective(self) -> None:
        """Apply the newest version received over the collective, if newer than the one served; refuse
        and flag what arrived with a bad digest or signature; check applied versions against their
        announcements as these arrive."""
        for bad in self.receiver.take_rejected():
            self._refuse_collective(bad.version, bad.problem, bad.digest)
        got = self.receiver.take(self.version)
        if got is not None:
            self.report("updating", False)
            try:
                # the engine may take the staging buffer itself (the torch backend, same dtype): no copy
                adopted = bool(self.backend.update_weights_from_tensors(got.state, adopt=True))
                failed = None
            except (ValueError, RuntimeError) as e:
                failed, adopted = e, False
            self.receiver.recycle(got, adopted)  # a buffer the engine no longer uses takes the next version
            if failed is not None:
                self._refuse_collective(got.version, f"apply_failed: {failed}", got.digest)
            else:
                self.version, self.digest, self.via = got.version, got.digest, self.receiver.via
                self.hash = ""  # the manifest hash of its files: known from the announcement (below)
                self.unconfirmed[got.version] = got.digest
                self.applied_digests[got.version] = got.digest
                for old in [v for v in self.applied_digests if v < got.version - 1000]:
                    del self.applied_digests[old]
                self.updates += 1
                self.collective_updates += 1
                latency = time.time() - got.received_at + got.seconds
                self.last_receive_s = got.seconds
                self.last_update_latency_s = round(latency, 4)
                emit_event(self.r, self.keys, "applied", generator=self.generator_id, version=got.version,
                           latency_s=latency, digest=got.digest, via=self.receiver.via)
                log.info("serving version %d (digest %s) via %s", got.version, got.digest[:12], self.receiver.via)
                self.report("sampling", True)
        self._confirm()

    def _confirm(self) -> None:
        """Compare each version applied via the collective with its signed announcement once that exists."""
        for v, digest in list(self.unconfirmed.items()):
            a = signed_announcement(self.r, self.keys, v, self.announce_key)  # a forged entry reads as none yet
            if a is None:
                if len(self.unconfirmed) > 64:  # never announced (the learner died after the broadcast)
                    del self.unconfirmed[v]
                continue
            del self.unconfirmed[v]
            if not a.digest or a.digest == digest:
                if v == self.version:
                    self.hash = a.hash
                continue
            self._refuse_collective(v, "announced_digest_mismatch", digest)
            if v == self.version:
                self.version = v - 1  # what we serve is not what was announced: load the store copy now

    def hash_for(self, version: int, wait_s: float = 30.0) -> str:
        """The manifest hash announced for ``version`` (what the broker checks a group's ``weight_hash``
        against). A version applied via the collective is served before its announcement exists: this
        waits for the announcement (at most ``wait_s``; "" then, and the broker rejects the group, counted).
        Called from the sink's thread, so generation never waits for it, and (``wait_s=0``) for heartbeats.
        Reads only: safe from any thread."""
        if version == self.version and self.hash:
            return self.hash
        deadline = time.monotonic() + wait_s
        while True:
            a = signed_announcement(self.r, self.keys, version, self.announce_key)
            if a is not None:
                applied = self.applied_digests.get(version)
                # a digest other than the one applied: flagged by _confirm; its groups must not pass
                return a.hash if not (a.digest and applied and a.digest != applied) else ""
            if time.monotonic() >= deadline or self.stopped():
                if wait_s > 0:
                    log.error("version %d was applied via the collective but not announced within %.0fs", version,
                              wait_s)
                return ""
            time.sleep(0.02)

    def _refuse_collective(self, version: int, reason: str, digest: str) -> None:
        """A version from the collective that is not served: flagged as a bad snapshot is (shown, counted,
        a ``refused`` event); the previous version keeps serving, later ones still arrive."""
        reason = reason.splitlines()[0][:200]
        self.refused[f"{self.receiver.via}:v{version}:{digest[:12]}"] = reason
        self.refused_updates += 1
        log.error("refused weight version %d received via %s (%s); still serving version %s",
                  version, self.receiver.via, reason, self.version)
        emit_event(self.r, self.keys, "refused", generator=self.generator_id, version=version, reason=reason,
                   via=self.receiver.via, digest=digest)

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
