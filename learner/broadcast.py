"""The ``collective`` weight transport, learner side: each version broadcast straight to the generators.

torch.distributed has no dynamic membership, so there is no global process group: the leader runs a
rendezvous (learner/rendezvous.py, on ``weights.transport.host``/``port``; the address is advertised
in Redis under ``Keys.collective``) and builds one independent 2-rank gloo group per generator session.
A generator joins by proving it holds the run's weights key; one whose id is already connected is
refused (the live member stays); a member whose connection to the rendezvous ends is dropped at once. A
generator that dies, hangs or joins never blocks the others.

Per version (:meth:`Broadcaster.send`, called by the publisher before it writes the store copy):
the tensors are copied into one flat uint8 buffer bucket by bucket, each bucket broadcast to every
member as soon as it is filled (asynchronously: the members receive in parallel, each on its group's
own threads), the tensor digest computed meanwhile; then the signed trailer
(broker/protocol/collective.py). A member whose broadcast fails or does not finish within
``weights.transport.timeout_s`` is dropped (counted, a ``collective_dropped`` event); it catches up
from the store copy and joins again. Back-pressure: ``send`` returns when every member has the
version or was dropped, so a slow generator delays the store copy of that version by at most
``timeout_s``, once.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from broker.client.telemetry import emit_event
from broker.protocol import collective as wire
from broker.protocol import signing
from broker.protocol.keys import Keys
from broker.protocol.tensordigest import DEFAULT as DEFAULT_DIGEST
from broker.protocol.tensordigest import combine
from broker.protocol.weights_config import CollectiveTransport
from learner.rendezvous import Rendezvous
from learner.transports import Sender, SenderContext

log = logging.getLogger("relay.learner.broadcast")


@dataclass
class Member:
    ticket: int
    generator: str
    session: str
    pg: object
    joined_at: float
    close: Callable[[], None] = lambda: None  # ends its membership (its rendezvous connection)
    versions: int = 0

    def release(self) -> None:
        """Abort its group and let it go: the group's connections close only when the group object is
        freed (gloo's abort does not wake the generator's pending receive), so the reference is dropped here
        even where a finished version's sends still hold this member."""
        pg, self.pg = self.pg, None
        if pg is not None:
            wire.abort_group(pg)


class Fanout:
    """One version's sends to the ``members`` present when it began: each member's pending works, and
    the members whose sends failed (dropped once the version is complete). A member that failed gets
    nothing more."""

    def __init__(self, members: list[Member], timeout_s: float):
        self.members, self.timeout_s = members, timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.works: dict[int, list] = {m.ticket: [] for m in members}
        self.failed: dict[int, str] = {}

    def issue(self, fn) -> None:
        """``fn(pg)`` (its works: asynchronous sends) on every member's group still in."""
        for m in self.members:
            if m.ticket in self.failed:
                continue
            if m.pg is None:
                self.failed[m.ticket] = "it left the weight broadcast"
                continue
            try:
                self.works[m.ticket].extend(fn(m.pg))
            except RuntimeError as e:
                self.failed[m.ticket] = str(e)

    def wait(self) -> None:
        """Wait for every member's sends, one deadline of ``timeout_s`` for all."""
        deadline = time.monotonic() + self.timeout_s
        for m in self.members:
            for w in self.works[m.ticket]:
                if m.ticket in self.failed:
                    break
                try:
                    w.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                except RuntimeError as e:
                    self.failed[m.ticket] = str(e)


def signed_trailer(key, run_id: str, version: int, digest: str, header: bytes, refused: ValueError | None) -> bytes:
    """The version's last blob: its digest (empty, with ``abort``, for a refused version), the header's
    hash, and the announcement ``key``'s signature of the three (empty without a key)."""
    header_sha = hashlib.sha256(header).hexdigest()
    return json.dumps(
        {
            "version": version,
            "digest": digest,
            "header_sha256": header_sha,
            "sig": signing.collective_signature(key, run_id, version, digest, header_sha) if key is not None else "",
            **({"abort": str(refused)[:200]} if refused is not None else {}),
        },
        separators=(",", ":"),
    ).encode()


class Broadcaster:
    """The leader's side of the collective transport. ``start`` opens the rendezvous; ``send`` (from
    the publisher's thread) broadcasts one version to the members present; ``close`` stops."""

    def __init__(
        self,
        r,
        keys: Keys,
        cfg: CollectiveTransport,
        announce_key: signing.AnnounceSigner | None,
        digest: str = DEFAULT_DIGEST,
        weights_key: bytes | None = None,
    ):
        if cfg.backend == "nccl" or (cfg.backend == "auto" and torch.cuda.is_available()):
            # the buckets are CPU tensors (the publication snapshot); NCCL groups would need them on a device
            log.warning(
                "weights.transport.backend=%s: this build sends CPU snapshots over gloo "
                "(docs/weights.md, 'NCCL on GPUs')",
                cfg.backend,
            )
        self.r, self.keys, self.cfg, self.key = r, keys, cfg, announce_key
        self.weights_key = weights_key  # who may join (None: weights.auth insecure, anyone who reaches the port)
        self.digest = digest  # the tensor digest's algorithm (weights.digest), named in each header
        self.members: dict[int, Member] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.dropped = 0
        self.rendezvous: Rendezvous | None = None
        self.port = 0
        self._hashers = [
            ThreadPoolExecutor(1, thread_name_prefix="relay-digest")  # hashing releases the GIL
            for _ in range(max(1, min(4, (os.cpu_count() or 1) - 1)))
        ]
        self._checker = ThreadPoolExecutor(
            1, thread_name_prefix="relay-publish-check"
        )  # send(check=) beside the buckets
        self._flat: torch.Tensor | None = None  # the previous version's buffer, reused (sent by the time send returns)

    def start(self) -> "Broadcaster":
        self.rendezvous = Rendezvous(
            self.cfg.host,
            self.cfg.port,
            self.weights_key,
            self.keys.run_id,
            self.cfg.timeout_s,
            self.cfg.max_members,
            self._joined,
            self._left,
        ).start()
        self.port = self.rendezvous.port
        self.r.hset(
            self.keys.collective,
            mapping={"host": self.cfg.host, "port": self.port, "pid": os.getpid(), "started_at": time.time()},
        )
        return self

    def close(self) -> None:
        self.stop.set()
        if self.rendezvous is not None:
            self.rendezvous.close()
        with self.lock:
            members, self.members = list(self.members.values()), {}
        for m in members:
            m.release()
            m.close()
        for pool in self._hashers:
            pool.shutdown(wait=False)
        self._checker.shutdown(wait=False)

    # -- membership (learner/rendezvous.py admits; these are its callbacks) -----------------------

    def _joined(self, ticket: int, gen: str, session: str, pg, close: Callable[[], None]) -> None:
        with self.lock:
            self.members[ticket] = Member(ticket, gen, session, pg, time.time(), close)
        log.info("generator %s joined the weight broadcast (session %s, ticket %d)", gen, session[:8], ticket)
        emit_event(self.r, self.keys, "collective_joined", generator=gen, session=session)

    def _left(self, ticket: int, gen: str, why: str) -> None:
        with self.lock:
            m = self.members.pop(ticket, None)
        if m is not None:  # not dropped by a broadcast first: it left (exited, or its machine is gone)
            m.release()
            log.info("generator %s left the weight broadcast (%s)", gen, why or "its connection closed")
            emit_event(self.r, self.keys, "collective_left", generator=gen, reason=why[:200])

    def member_ids(self) -> list[str]:
        with self.lock:
            return sorted(m.generator for m in self.members.values())

    # -- one version ----------------------------------------------------------------------------

    def _layout(self, tensors: list[tuple[str, str, tuple[int, ...]]]) -> wire.Layout:
        return wire.plan(tensors, max(wire.ALIGN, int(self.cfg.bucket_mb * (1 << 20))), self.digest)

    def buffers(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Empty snapshot buffers for ``state`` (floating-point tensors in ``dtype``): views into one flat
        buffer laid out as :meth:`send` broadcasts it, so that the snapshot written into them (publish.py
        ``snapshot(into=...)``) is sent as it lies, without a copy into a bucket buffer."""
        want = {k: dtype if v.is_floating_point() else v.dtype for k, v in state.items()}
        layout = self._layout([(k, str(want[k]).removeprefix("torch."), tuple(v.shape)) for k, v in state.items()])
        # alignment gaps stay zero; page-locked for weights on a GPU (publish.py fill: copies queued together)
        flat = torch.zeros(layout.total, dtype=torch.uint8, pin_memory=any(v.is_cuda for v in state.values()))
        return {
            s.name: flat[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
            for s in layout.slots
        }

    @staticmethod
    def _lies_in_buffer(state: dict[str, torch.Tensor], layout: wire.Layout) -> torch.Tensor | None:
        """The flat buffer that holds every tensor of ``state`` at its offset of ``layout`` (a snapshot
        taken into :meth:`buffers`: all its tensors view one storage, each at its slot), as a uint8 tensor
        over that storage; None otherwise (then send copies). Read from the tensors themselves: nothing
        keeps the buffers alive but the snapshots that use them."""
        views = [state[s.name] for s in layout.slots if s.nbytes]
        if not views or any(t.device.type != "cpu" for t in views):
            return None
        storage = views[0].untyped_storage()
        base = storage.data_ptr()
        if storage.nbytes() < layout.total or any(
            t.untyped_storage().data_ptr() != base or t.data_ptr() != base + s.offset or not t.is_contiguous()
            for s, t in zip((s for s in layout.slots if s.nbytes), views)
        ):
            return None
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (layout.total,))

    def _flat_for(self, state: dict[str, torch.Tensor], layout: wire.Layout) -> tuple[torch.Tensor, bool]:
        """The flat buffer ``state`` is sent from, and whether it is the snapshot's own (taken into
        :meth:`buffers`: sent as it lies) rather than the reused copy buffer."""
        flat = self._lies_in_buffer(state, layout)
        if flat is not None:
            return flat, True
        if self._flat is None or self._flat.numel() != layout.total:
            self._flat = torch.zeros(layout.total, dtype=torch.uint8)  # alignment gaps stay zero: never written
        return self._flat, False

    def send(
        self, version: int, state: dict[str, torch.Tensor], check: Callable[[], None] | None = None, progress=None
    ) -> str:
        """Broadcast ``state`` (CPU tensors in the publication dtype) as ``version`` to every member;
        return its tensor digest (computed from the bytes sent). Members that fail are dropped.
        ``check`` (the finiteness check) runs beside the buckets; when it raises a ValueError the version
        is aborted: its trailer carries an empty digest and ``abort`` (signed like any other), every member
        discards what it received, and the error is raised here once the trailer has left. ``progress``
        (learner/publish.py ``Progress``): ``state`` is still being copied; each bucket leaves as soon as
        its tensors are filled (a copy that fails aborts the version the same way)."""
        t0 = time.perf_counter()
        checking = self._checker.submit(check) if check is not None else None
        layout = self._layout([(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state.items()])
        header = layout.header(version)
        with self.lock:
            fanout = Fanout(list(self.members.values()), self.cfg.timeout_s)
        fanout.issue(lambda pg: wire.send_blob(pg, header, fanout.timeout))
        flat, in_place = self._flat_for(state, layout)
        hashes = wire.BucketHasher(layout, flat, self._hashers)
        refused = self._send_buckets(layout, state, flat, in_place, fanout, hashes, progress)
        try:
            if checking is not None:
                checking.result()
        except (ValueError, RuntimeError) as e:  # not finite, or the copy failed
            refused = refused or (e if isinstance(e, ValueError) else ValueError(str(e)))
        digest = "" if refused is not None else combine(hashes.entries(), layout.digest)
        trailer = signed_trailer(self.key, self.keys.run_id, version, digest, header, refused)
        fanout.issue(lambda pg: wire.send_blob(pg, trailer, fanout.timeout))
        self._complete(fanout, version)
        log.info(
            "broadcast version %d (%.1f MiB, %d bucket(s), %s) to %d of %d generator(s) in %.3fs",
            version,
            layout.total / (1 << 20),
            len(layout.buckets),
            "from the snapshot" if in_place else "copied",
            len(fanout.members) - len(fanout.failed),
            len(fanout.members),
            time.perf_counter() - t0,
        )
        if refused is not None:
            raise refused
        return digest

    @staticmethod
    def _send_buckets(layout, state, flat, in_place: bool, fanout: Fanout, hashes, progress) -> ValueError | None:
        """Each bucket of ``layout`` filled from ``state`` into ``flat`` (unless the snapshot lies there
        ``in_place``), broadcast to the members and hashed; what refused the version when its copy
        (``progress``) failed (the rest leaves as it is, the trailer aborts), else None."""
        filled = 0  # slots[:filled] are in the buffer
        refused: ValueError | None = None
        for start, end in layout.buckets or [(0, 0)]:
            first = filled
            while filled < len(layout.slots) and layout.slots[filled].offset < max(end, 1):
                filled += 1  # every tensor that begins in this bucket, filled before it leaves
            if progress is not None and refused is None:
                try:
                    progress.wait([s.name for s in layout.slots[:filled]])
                except RuntimeError as e:  # the copy failed: the rest leaves as it is, the trailer aborts
                    refused = ValueError(str(e))
            for s in layout.slots[first:filled]:
                if s.nbytes and not in_place and refused is None:
                    flat[s.offset : s.offset + s.nbytes].copy_(
                        state[s.name].detach().contiguous().reshape(-1).view(torch.uint8)
                    )
            if end > start:
                bucket = flat[start:end]
                fanout.issue(lambda pg: [pg.broadcast(bucket, 0, fanout.timeout)])
            hashes.add(start, end)  # beside its sending, while the bucket is warm in the cache
        return refused

    def _complete(self, fanout: Fanout, version: int) -> None:
        """Wait for every member's sends; drop the members that failed."""
        fanout.wait()
        fanout.works.clear()  # done: a work kept (a raised error's frame holds this fanout) keeps its group open
        for m in fanout.members:
            if m.ticket in fanout.failed:
                self._drop(m, fanout.failed[m.ticket], version)
            else:
                m.versions += 1

    def _drop(self, m: Member, why: str, version: int) -> None:
        with self.lock:
            self.members.pop(m.ticket, None)
        self.dropped += 1
        m.release()
        m.close()  # its id is free again: it rejoins once it notices
        log.warning(
            "dropped generator %s from the weight broadcast at version %d (%s); it catches up from the "
            "store and joins again",
            m.generator,
            version,
            why.splitlines()[0][:200],
        )
        emit_event(
            self.r,
            self.keys,
            "collective_dropped",
            generator=m.generator,
            version=version,
            reason=why.splitlines()[0][:200],
        )


class CollectiveSender(Sender):
    """``weights.transport = "collective"``, learner side (learner/transports.py): the :class:`Broadcaster`,
    started at once (its rendezvous listens), takes each version before the store copy is written."""

    name = "collective"

    def __init__(self, ctx: SenderContext):
        super().__init__(ctx)
        cfg = ctx.cfg.weights
        self.handoff = Broadcaster(
            ctx.r, ctx.keys, cfg.transport, ctx.announce_key, cfg.digest, ctx.weights_key
        ).start()
