"""The ``ipc`` weight transport, generator side: a thread that copies each version the learner on this host
shares (learner/ipc.py; the contract in broker/protocol/ipc.py) into a buffer of its own.

The generator first loads the newest stored version as with every transport, then :meth:`IpcReceiver.start`
follows ``staged`` and ``current`` in Redis (every ``poll_s``). For each newer version it maps the learner's
two slots (once per epoch: CUDA IPC for a learner's GPU memory, a shared-memory segment for its CPU
memory), copies the version's slot into a staging buffer on the engine's device (device to device on a
GPU) and checks the slot's sequence number before and after: a slot rewritten meanwhile (the learner
moved two versions on) makes the copy *superseded*, discarded, never refused. The copy and its digest
start as soon as ``staged`` names the version, beside the learner's own check and digest; only when
``current`` confirms the same version, slot and sequence number is the copy checked: the signature of
``current`` (the run's public announcement key) and the digest of the bytes copied against the signed one. A
version that fails is *rejected* (refused and flagged by the WeightApplier, never applied), otherwise
*ready*. The
WeightApplier (generators/weights.py) applies the newest ready version between batches; the torch
backend adopts the staging buffer (no second copy).

A learner that is gone, or slots this process cannot map (another host, another IPC namespace), leave
the generator following the announcements and the store, as with ``transport = "store"``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import redis
import torch

from broker.protocol import collective as wire
from broker.protocol import ipc, signing
from broker.protocol.keys import Keys
from broker.protocol.tensordigest import state_digest
from generators.weight_receive import Received, Staging
from generators.transports import ReceiverContext, Receiving

log = logging.getLogger("relay.generator.ipc")


@dataclass
class _Copy:
    """A version copied out of a slot into a staging buffer, and the digest of the copy."""

    version: int
    slot: int
    seq: int
    epoch: int
    flat: torch.Tensor = field(repr=False)
    state: dict = field(repr=False)
    digest: str
    started: float  # perf_counter when its copy began


@dataclass
class _Slots:
    """The learner's two slots as this receiver mapped them: their ``epoch`` (allocation), the version layout
    and its header's sha256, the mapped buffers and what keeps their mappings open."""

    epoch: int
    layout: wire.Layout
    header_sha: str
    mapped: list[torch.Tensor]
    keep: list


class IpcReceiver(Staging):
    """``tamper(flat)`` is a test hook: it may alter the generator's copy right after it landed, as a
    faulty copy would; ``after_copy()`` another, called between the copy and the second sequence check."""

    via = "ipc"

    def __init__(
        self,
        r,
        keys: Keys,
        generator_id: str,
        announce_key: signing.AnnounceVerifier | None,
        device: str = "cpu",
        poll_s: float = 0.01,
        max_bytes: int = 1 << 40,
        tamper: Callable[[torch.Tensor], None] | None = None,
        after_copy: Callable[[], None] | None = None,
    ):
        super().__init__(device)
        self.r, self.keys, self.generator_id, self.key = r, keys, generator_id, announce_key
        self.poll_s, self.max_bytes, self.tamper, self.after_copy = poll_s, max_bytes, tamper, after_copy
        self.superseded = 0  # copies discarded because the learner rewrote the slot meanwhile
        self.slots: _Slots | None = None  # the learner's slots, mapped
        self._seen = b""  # the last ``current`` entry handled
        self._seen_staged = b""  # the last ``staged`` entry looked at
        self._pending: _Copy | None = None  # a version copied ahead of its ``current`` entry
        self._newest = -1  # the newest version copied (or refused)
        self._wake = threading.Event()  # catch_up(): look at ``current`` now
        self._handled = threading.Condition()  # notified each time an entry of ``current`` has been handled

    def _interrupt(self) -> None:
        self._wake.set()

    def catch_up(self, version: int, timeout: float = 10.0) -> bool:
        """Called when ``version`` is announced before this receiver delivered it (the announcement follows
        ``current`` closely; the poll may not have looked yet): look now, and wait (at most ``timeout``)
        until it is handled. True when it was (ready, refused or superseded by a newer one); False when
        not receiving, or it never came (the generator then loads it from the store)."""
        if not self.joined.is_set():
            return False
        try:
            raw = self.r.hget(self.keys.ipc, "current")
            if raw is None or ipc.parse_current(raw)["version"] < version:
                return False  # not shared in the slots (the learner's log says why): the store has it
        except (redis.RedisError, OSError, ValueError) as e:
            log.warning("cannot read the ipc transport's current entry: %s", e)
            return False
        with self._handled:
            self._wake.set()
            return (
                self._handled.wait_for(lambda: self._newest >= version or self.stop.is_set(), timeout)
                and self._newest >= version
            )

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                staged, current = self.r.hmget(self.keys.ipc, ["staged", "current"])
                if current is not None and current != self._seen:
                    self._seen = current
                    try:
                        self._receive(ipc.parse_current(current))
                    finally:
                        with self._handled:
                            self._handled.notify_all()
                elif staged is not None and staged != self._seen_staged:
                    self._seen_staged = staged
                    self._precopy(ipc.parse_staged(staged))
                else:
                    self._wake.wait(self.poll_s)
                    self._wake.clear()
            except (
                redis.RedisError,
                OSError,
                RuntimeError,
                ValueError,
            ) as e:  # Redis away, slots gone or not mappable here
                if self.joined.is_set():
                    log.warning(
                        "stopped receiving over ipc (%s); following the store until the slots can be mapped again",
                        str(e).splitlines()[0][:200],
                    )
                self.joined.clear()
                self.slots, self._pending = None, None
                self.stop.wait(1.0)

    def _map(self, epoch: int) -> None:
        """Map the learner's slots of ``epoch`` (its latest allocation)."""
        if self._pending is not None:  # a copy out of the previous slots
            self._discard(self._pending.flat)
            self._pending = None
        fields = self.r.hmget(self.keys.ipc, ["epoch", "header", "slot0", "slot1"])
        if fields[0] is None or int(fields[0]) != epoch or None in fields:
            raise ipc.IpcError(f"the slots of epoch {epoch} are no longer advertised")
        _, layout = wire.parse_header(fields[1], self.max_bytes)
        mapped, keep = [], []
        for raw in fields[2:]:
            flat, k = ipc.open_buffer(raw)
            if flat.numel() < layout.total:
                raise ipc.IpcError(f"a slot of {flat.numel()} bytes for a layout of {layout.total}")
            mapped.append(flat[: layout.total])
            keep.append(k)
        self.slots = _Slots(epoch, layout, hashlib.sha256(fields[1]).hexdigest(), mapped, keep)
        self.joins += 1
        self.joined.set()
        log.info(
            "mapped the learner's ipc slots (epoch %d, %.1f MiB each, on %s)",
            epoch,
            layout.total / (1 << 20),
            mapped[0].device,
        )

    def _seq(self, slot: int) -> int:
        return int(self.r.hget(self.keys.ipc, f"seq{slot}") or -1)

    def _precopy(self, st: dict) -> None:
        """Copy and digest a version the learner has just written, while it checks and digests it too: its
        ``current`` entry then finds the work done (:meth:`_receive`). One at a time (one staging buffer)."""
        if st["version"] <= self._newest or self._pending is not None:
            return
        if self.slots is None or st["epoch"] != self.slots.epoch:
            self._map(st["epoch"])
        self._pending = self._copy(st["version"], st["slot"], st["seq"])

    def _copy(self, version: int, slot: int, seq: int) -> _Copy | None:
        """``version`` copied out of ``slot`` (sequence number ``seq``) into a staging buffer and digested;
        None when the learner rewrote the slot before or during the copy (superseded: a newer one follows)."""
        t0 = time.perf_counter()
        if self._seq(slot) != seq:  # already rewritten
            self.superseded += 1
            return None
        layout = self.slots.layout
        flat = self._buffer(layout.total)
        flat.copy_(self.slots.mapped[slot], non_blocking=True)
        if flat.is_cuda or self.slots.mapped[slot].is_cuda:
            torch.cuda.synchronize(flat.device if flat.is_cuda else self.slots.mapped[slot].device)
        if self.after_copy is not None:
            self.after_copy()
        if self._seq(slot) != seq:  # the learner rewrote the slot during the copy: torn, discarded
            self.superseded += 1
            self._discard(flat)
            log.info(
                "version %d was rewritten in its slot while it was copied: discarded (a newer one follows)", version
            )
            return None
        if self.tamper is not None:
            self.tamper(flat)
        state = {
            s.name: flat[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
            for s in layout.slots
        }
        return _Copy(version, slot, seq, self.slots.epoch, flat, state, state_digest(state, layout.digest), t0)

    def _receive(self, cur: dict) -> None:
        """A new ``current`` entry: its version copied (or the copy made ahead of it taken), checked against
        the signed digest, delivered (ready or refused)."""
        version, slot = cur["version"], cur["slot"]
        if version <= self._newest:
            return
        if self.slots is None or cur["epoch"] != self.slots.epoch:
            self._map(cur["epoch"])
        ahead, self._pending = self._pending, None
        if ahead is not None and (ahead.version, ahead.slot, ahead.seq, ahead.epoch) == (
            version,
            slot,
            cur["seq"],
            cur["epoch"],
        ):
            copied = ahead
        else:
            if ahead is not None and ahead.version > version:  # a newer one is copied already: this one is skipped
                self._pending, self._newest = ahead, version
                self.superseded += 1
                return
            if ahead is not None:
                self._discard(ahead.flat)
            copied = self._copy(version, slot, cur["seq"])
            if copied is None:
                return
        self._newest = version
        problem = None
        if self.key is not None:
            problem = signing.check_collective(
                self.key, self.keys.run_id, version, cur["digest"], cur["header_sha256"], cur["sig"]
            )
        if problem is None and cur["header_sha256"] != self.slots.header_sha:
            problem = "header_mismatch"
        if problem is None and cur["digest"] != copied.digest:
            problem = "digest_mismatch"
        seconds = time.perf_counter() - copied.started
        self._deliver(
            Received(version, copied.digest, copied.state, problem, cur["digest"], time.time(), seconds, copied.flat)
        )
        log.debug(
            "version %d (%.1f MiB) from slot %d ready %.3fs after its copy began%s",
            version,
            self.slots.layout.total / (1 << 20),
            slot,
            seconds,
            " (copied ahead)" if copied is ahead else "",
        )


def receiving(ctx: ReceiverContext) -> Receiving:
    """``weights.transport = "ipc"``, generator side (generators/transports.py): an :class:`IpcReceiver` copying
    each version from the learner's shared slots onto this backend's device."""
    return Receiving(
        tensors=IpcReceiver(
            ctx.r, ctx.keys, ctx.cfg.id, ctx.announce_key, device=str(getattr(ctx.backend, "device", "cpu"))
        )
    )
