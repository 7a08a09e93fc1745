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
backend): the files the check hashed are what the engine loads (:meth:`VersionFiles.obtain`).

Versions received in process (the collective and ipc transports) are applied by generators/received.py.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import redis

from broker.client.announcements import ForgedAnnouncement, checked_latest, newest_signed, signed_announcement
from broker.client.telemetry import emit_event
from broker.protocol import weightstore
from broker.protocol.keys import Keys
from broker.protocol.signing import AnnounceVerifier
from generators.backends.base import Backend
from generators.received import ReceivedVersions

log = logging.getLogger("relay.generator.weights")


class VersionFiles:
    """Where a version's files come from, checked against its announcement: read in place from the weight
    store (``store``: the folder every version must be in; None, anywhere), or fetched over HTTP first
    (``fetcher``: weights.transport http, generators/weight_fetch.py). ``hash_threads``: a version's files
    verified side by side (weights.hash_threads)."""

    def __init__(self, store: str | None, fetcher=None, hash_threads: int = 1):
        self.store, self.fetcher, self.hash_threads = store, fetcher, hash_threads

    def obtain(self, a, serving: int | None, keep: bool):
        """(the local folder of version ``a``, the digest of its tensors, what its check kept or None), its
        files checked against the announced hash and digest: read in place from the store, or fetched over
        HTTP (the fetcher checked hash and digest as the bytes came). WeightStoreError otherwise.

        ``serving``: the version served now (None before the first). ``keep``: for an engine that loads what
        it is handed (the torch backend: ``loads_mapped_files``), every load
        (the first, each update, a LoRA adapter, its base) keeps what the check read: the safetensors files
        mapped, the other files' bytes (weightstore.check ``keep``; over HTTP, the files the fetcher wrote and
        hashed, mapped through the same open files). The engine loads the bytes that were hashed (a file
        renamed into the folder after the check is not loaded), and the files are read once."""
        if self.fetcher is None:
            v = weightstore.check(
                a.path, a.hash, self.store, expected_digest=a.digest or None, threads=self.hash_threads, keep=keep
            )
            return a.path, v.digest, (v if keep else None)
        path, v = self.fetcher.fetch_kept(a, serving, keep)
        digest = self.fetcher.digests.get(a.version)
        if a.digest and digest != a.digest:
            if v is not None:
                v.close()
            raise weightstore.WeightStoreError(
                "digest_mismatch",
                f"{path}: the tensors' digest {(digest or '')[:12]} differs from the announced {a.digest[:12]}",
            )
        return path, digest, v


class Refusals:
    """What a generator refused, shown in its heartbeat (the last few), its /metrics and the dashboard: snapshots
    that failed their check (``bad``: never retried), versions received in process that failed theirs
    (generators/received.py), and forged announcements (each shown and counted once; not a refused update, as
    the newest signed version stands instead)."""

    def __init__(self):
        # what -> reason: a snapshot's hash, "<via>:v<version>:<digest>" of a received version, a forged hash
        self.reasons: dict[str, str] = {}
        self.bad: set[str] = set()  # hashes of snapshots that failed verification: never retried
        self.updates = 0  # updates refused
        self._forged: set[tuple[str, str]] = set()  # (hash, signature) of each forged announcement seen

    @property
    def forged_announcements(self) -> int:
        """Distinct announcements seen whose signature is missing or wrong (each counted once)."""
        return len(self._forged)

    def snapshot(self, hash: str, reason: str) -> None:
        """A snapshot (its manifest hash) that failed its check: refused for good."""
        self.reasons[hash] = reason
        self.bad.add(hash)
        self.updates += 1

    def received(self, label: str, reason: str) -> None:
        """A version received in process (``label``: via, version, digest) that is not served."""
        self.reasons[label] = reason
        self.updates += 1

    def forged(self, a, reason: str) -> bool:
        """Announcement ``a`` whose signature is missing or wrong: True the first time it is seen. Shown only: a
        signed announcement of the same hash still loads."""
        if (a.hash, a.sig) in self._forged:
            return False
        self._forged.add((a.hash, a.sig))
        self.reasons[a.hash] = reason
        return True


class WeightApplier:
    """The version a generator serves, and how it changes.

    ``report(state, heartbeat)`` tells the generator what it is doing (``waiting_for_weights``,
    ``updating``, ``sampling``) and whether to send a heartbeat now."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        backend: Backend,
        generator_id: str,
        report: Callable[[str, bool], None] = lambda state, heartbeat: None,
        stopped: Callable[[], bool] = lambda: False,
        announce_key: AnnounceVerifier | None = None,
        store: str = "",
        fetcher=None,
        receiver=None,
        hash_threads: int = 1,
        engine_lock: threading.RLock | None = None,
    ):
        self.r, self.keys, self.backend, self.generator_id = r, keys, backend, generator_id
        self.announce_key = announce_key  # None: announcements are not checked (announce_auth insecure)
        self.files = VersionFiles(store or None, fetcher, hash_threads)  # where a version's files come from, checked
        self.refusals = Refusals()  # snapshots refused, forged announcements: what the heartbeat shows red
        self.report, self.stopped = report, stopped
        self.version: int | None = None  # the version served (None before the first load)
        self.hash = ""
        self.digest = ""  # the tensor digest of the version served ("" when its announcement had none)
        self.base_digest = ""  # LoRA adapters: the digest of the base model served under them ("" without)
        self.updates = 0
        self.last_update_latency_s: float | None = None
        self.via = "store"  # how the version served arrived: store, http, collective or ipc
        # the collective and ipc transports (generators/received.py): versions that arrive in process before
        # their announcement (the receiver None with the other transports)
        self.received = ReceivedVersions(self, receiver)
        # held while a version is loaded into the engine and made the version served: the generator's callers
        # of backend.generate (its loop, evaluation, the OpenAI endpoint) hold it too, so they take turns
        self.engine_lock = engine_lock if engine_lock is not None else threading.RLock()

    @property
    def refused(self) -> dict[str, str]:
        """What was refused -> why (:class:`Refusals`): the heartbeat shows the last few."""
        return self.refusals.reasons

    @property
    def refused_updates(self) -> int:
        return self.refusals.updates

    @property
    def forged_announcements(self) -> int:
        return self.refusals.forged_announcements

    @property
    def receiver(self):
        """The in-process transport's receiver (generators/weight_receive.py, generators/ipc_receive.py), or None."""
        return self.received.receiver

    @property
    def collective_updates(self) -> int:
        """Versions applied from the receiver (collective or ipc)."""
        return self.received.updates

    @property
    def last_receive_s(self) -> float | None:
        """How long the receiver took to receive and check the last version it delivered."""
        return self.received.last_receive_s

    def hash_for(self, version: int, wait_s: float = 30.0) -> str:
        """The manifest hash announced for ``version`` (generators/received.py ``ReceivedVersions.hash_for``)."""
        return self.received.hash_for(version, wait_s)

    def update(self, block: bool = False) -> None:
        """Apply the latest announced version if it is newer than the one served. ``block``: wait
        (every 0.2 s) until a first version is announced. Under the engine lock (re-entrant: the "continue"
        in-flight policy updates from inside ``generate``)."""
        with self.engine_lock:
            self._update(block)

    def _update(self, block: bool) -> None:
        if self.receiver is not None and self.version is not None:
            self.received.apply_newest()
        while True:
            a = self._latest()
            if a is not None or not block or self.stopped():
                break
            self.report("waiting_for_weights", True)
            time.sleep(0.2)
        if (
            a is not None
            and self.receiver is not None
            and self.version is not None
            and a.version > self.version
            and self.receiver.catch_up(a.version)
        ):  # announced just before the receiver delivered it
            self.received.apply_newest()
        while a is not None and (self.version is None or a.version > self.version) and a.hash not in self.refusals.bad:
            self.report("updating", False)
            try:
                path, digest, verified = self.files.obtain(a, self.version, self._keeps())
                try:
                    if a.adapter_only:  # a LoRA adapter alone: onto the base it pins (loaded first on a fresh start)
                        if self.version is None:
                            self._load_base(a)
                        elif self.base_digest != a.base_digest:
                            raise weightstore.WeightStoreError(
                                "base_mismatch",
                                f"version {a.version} is an adapter for the base model "
                                f"{a.base_digest[:12] or '?'} (version {a.base}); this generator serves the base "
                                f"{self.base_digest[:12] or 'of a model without adapters'}",
                            )
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
                    log.warning(
                        "version %d was superseded while loading (%s); loading version %d instead",
                        a.version,
                        e,
                        newer.version,
                    )
                    a = newer
                    continue
                self._refuse(a, e)
                return
        else:
            return
        latency = time.time() - a.published_at
        self.version, self.hash, self.digest = a.version, a.hash, digest or ""
        self.base_digest = a.base_digest if a.base is not None else ""
        self.via = "http" if self.files.fetcher else "store"
        self.updates += 1
        self.last_update_latency_s = round(latency, 4)
        emit_event(
            self.r,
            self.keys,
            "applied",
            generator=self.generator_id,
            version=a.version,
            latency_s=latency,
            digest=self.digest,
            via=self.via,
        )
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

    def _keeps(self) -> bool:
        """The engine loads what it is handed (the torch backend): the check keeps what it read for the load."""
        return bool(getattr(self.backend, "loads_mapped_files", False))

    def _load_base(self, a) -> None:
        """Start the engine from the version that carries the base model the adapter ``a`` pins (its signed
        announcement must say it carries that base). WeightStoreError ``missing_base`` otherwise."""
        b = signed_announcement(self.r, self.keys, a.base, self.announce_key)
        if b is None or b.base != b.version or b.base_digest != a.base_digest:
            found = "not announced" if b is None else f"announced with base {b.base} ({b.base_digest[:12]})"
            raise weightstore.WeightStoreError(
                "missing_base",
                f"version {a.version} is an adapter for the base model "
                f"of version {a.base} ({a.base_digest[:12]}), which is {found}",
            )
        path, _, verified = self.files.obtain(b, self.version, self._keeps())
        log.info("loading the base model from version %d for the adapter of version %d", b.version, a.version)
        try:
            self._engine("load", path, verified)
        finally:
            if verified is not None:
                verified.close()

    def _latest(self):
        """The latest announcement signed by the run's key (None before the first). A forged one in
        ``latest`` is logged, counted once and reported; the newest signed version stands instead."""
        try:
            return checked_latest(self.r, self.keys, self.announce_key)
        except ForgedAnnouncement as e:
            a = e.announcement
            if self.refusals.forged(a, e.reason):
                log.error(
                    "ignored a forged weight announcement (%s): version %d, hash %s, path %s; still serving version %s",
                    e.reason,
                    a.version,
                    a.hash[:12],
                    a.path,
                    self.version,
                )
                emit_event(
                    self.r, self.keys, "refused", generator=self.generator_id, version=a.version, reason=e.reason
                )
            return newest_signed(self.r, self.keys, self.announce_key)

    def _refuse(self, a, e: Exception) -> None:
        reason = getattr(e, "reason", type(e).__name__)
        self.refusals.snapshot(a.hash, reason)
        log.error("refused weight version %d (%s): %s; still serving version %s", a.version, reason, e, self.version)
        emit_event(self.r, self.keys, "refused", generator=self.generator_id, version=a.version, reason=reason)
        if self.version is None:
            raise RuntimeError(f"cannot load the initial weights: {e}") from e
