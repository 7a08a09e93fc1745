"""The ``ipc`` weight transport, learner side: each version handed to the generators on this host through
shared memory (the contract in broker/protocol/ipc.py; the generator side in generators/ipc_receive.py).

Two slots, flat buffers laid out as the collective transport lays a version out, hold the two newest
versions. Weights on a GPU are copied into the free slot on the device by the learner itself
(:meth:`IpcSharer.stage`, beside the host snapshot: a device-to-device copy, ~1 ms a GB on an H200) and
reach the generators through CUDA IPC; weights on the CPU are copied from the host snapshot into a
shared-memory slot by the publisher's thread (:meth:`IpcSharer.send`). Either way the publisher's thread
then checks the slot finite, computes its tensor digest, signs it and writes ``current``, before the
store copy is written (for late joiners, restarts and the audit), as the collective transport does.

A version whose tensors differ from the slots' layout (LoRA adapters published alone after the base)
is not shared: the generators load it from the store copy. GPU memory: two copies of the model in the
publication dtype (30 GB for a 7B model in bf16), for the run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
import time
from typing import Callable

import torch

from broker.protocol import collective as wire
from broker.protocol import ipc, signing
from broker.protocol.keys import Keys
from broker.protocol.tensordigest import DEFAULT as DEFAULT_DIGEST
from broker.protocol.tensordigest import state_digest
from learner.publish import refuse_nonfinite
from learner.transports import Sender, SenderContext

log = logging.getLogger("relay.learner.ipc")


class IpcSharer:
    """The leader's side of the ipc transport, in the publisher's place of the collective's Broadcaster:
    :meth:`stage` (learner thread, weights on a GPU), :meth:`send` (publisher thread), :meth:`close`."""

    via = "ipc"

    def __init__(self, r, keys: Keys, announce_key: signing.AnnounceSigner | None, digest: str = DEFAULT_DIGEST):
        self.r, self.keys, self.key, self.digest = r, keys, announce_key, digest
        self.layout: wire.Layout | None = None
        self.header = b""
        self.slots: list[torch.Tensor] = []
        self.epoch = 0
        self.device: torch.device | None = None
        self.lock = threading.Lock()
        self._next = 0  # the slot the next version goes into
        self._busy: int | None = None  # the slot send() is reading (stage() leaves it alone)
        self._staged: dict[int, tuple[int, int]] = {}  # version -> (slot, seq) written by stage()
        self.shared = 0  # versions written into a slot and announced in ``current``
        self.superseded = 0  # versions whose slot was rewritten before they were announced there
        self.not_shared = 0  # versions whose tensors differ from the slots' layout (the store copy serves them)

    def start(self) -> "IpcSharer":
        self._unlink_previous()
        return self

    def buffers(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """The snapshot allocates its own buffers (the slots are not where the store copy is written from)."""
        return None

    # -- the slots ------------------------------------------------------------------------------

    def _plan(self, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> wire.Layout:
        """The slots' layout for ``state`` with its floating-point tensors in ``dtype`` (None: as they are)."""
        want = {k: dtype if dtype is not None and v.is_floating_point() else v.dtype for k, v in state.items()}
        return wire.plan(
            [(k, str(want[k]).removeprefix("torch."), tuple(v.shape)) for k, v in state.items()], 1 << 30, self.digest
        )

    def _slots_for(self, layout: wire.Layout, device: torch.device) -> bool:
        """Allocate and advertise the slots for ``layout`` on ``device`` the first time; afterwards False
        when ``layout`` or ``device`` is not the slots' (the version is not shared)."""
        if self.layout is not None:
            return layout == self.layout and device == self.device
        self.epoch = int(self.r.hincrby(self.keys.ipc, "epoch", 1))
        tag = f"relay-ipc-{os.getpid()}-{secrets.token_hex(4)}"
        self.slots = [ipc.shared_buffer(layout.total, device, f"{tag}-{i}") for i in (0, 1)]
        for s in self.slots:
            s.zero_()  # alignment gaps stay zero (the digest never reads them; a copy of the slot is clean)
        self.layout, self.device, self.header = layout, device, layout.header(0)
        self.r.hset(
            self.keys.ipc,
            mapping={
                "header": self.header,
                "slot0": ipc.export_buffer(self.slots[0]),
                "slot1": ipc.export_buffer(self.slots[1]),
                "seq0": 0,
                "seq1": 0,
                "pid": os.getpid(),
                "started_at": time.time(),
            },
        )
        self.r.hdel(self.keys.ipc, "current", "staged")  # a predecessor's, for slots that are gone
        log.info(
            "ipc weight transport: two slots of %.1f MiB on %s (epoch %d)", layout.total / (1 << 20), device, self.epoch
        )
        return True

    def _views(self, slot: int) -> dict[str, torch.Tensor]:
        flat = self.slots[slot]
        return {
            s.name: flat[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
            for s in self.layout.slots
        }

    def _write(self, state: dict[str, torch.Tensor]) -> tuple[int, int]:
        """Copy ``state`` into the free slot under its seqlock; (slot, seq) once it has landed. The free
        slot is the one the newest version is not in, unless send() is still reading that one (then the
        other: it holds a version staged but not yet taken, which a newer one replaces anyway)."""
        slot = self._next if self._next != self._busy else 1 - self._next
        self._next = 1 - slot
        self.r.hincrby(self.keys.ipc, f"seq{slot}", 1)  # odd: a generator copying this slot now discards its copy
        views = self._views(slot)
        with torch.no_grad():
            for name, dst in views.items():
                dst.copy_(state[name].detach(), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        seq = int(self.r.hincrby(self.keys.ipc, f"seq{slot}", 1))
        return slot, seq

    def _mark_staged(self, version: int, slot: int, seq: int) -> None:
        """Tell the generators ``version`` lies in ``slot``: they may copy and digest it while this process
        checks and digests it (they apply it only once ``current`` confirms it)."""
        self.r.hset(self.keys.ipc, "staged", ipc.encode_staged(version, slot, seq, self.epoch))

    # -- one version ----------------------------------------------------------------------------

    def stage(self, version: int, weights: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool) -> None:
        """In the learner's thread, before the step after this one changes ``weights``: weights on a GPU are
        copied into the free slot now, on the device (their stream orders the copy before the next step).
        Weights on the CPU are left to :meth:`send` (from the host snapshot, off the learner's path)."""
        state = {k: v for k, v in weights.items() if not (tied and k == "lm_head.weight")}
        devices = {t.device for t in state.values()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return
        with self.lock:
            if self._slots_for(self._plan(state, dtype), next(iter(devices))):
                # an older version staged but not taken is dropped (the publisher skips it for this one)
                self._staged = {version: self._write(state)}
                self._mark_staged(version, *self._staged[version])

    def send(
        self, version: int, state: dict[str, torch.Tensor], check: Callable[[], None] | None = None, progress=None
    ) -> str:
        """In the publisher's thread: make ``version`` (``state``, its host snapshot) the ``current`` one and
        return its tensor digest. ``check`` (the finiteness check of the snapshot; it waits for ``progress``,
        the snapshot's copy) raises for a version that must not be published: nothing is announced then.
        A version staged on a GPU is checked in its slot instead (on the device), and the snapshot waited
        for only after the generators have it (the store copy that follows needs it)."""
        with self.lock:
            staged = self._staged.pop(version, None)
            self._busy = staged[0] if staged is not None else None
        try:
            return self._send(version, state, staged, check, progress)
        finally:
            self._busy = None

    def _send(self, version, state, staged, check, progress) -> str:
        if staged is not None:  # the slot stays as stage() wrote it until this returns (``_busy``)
            refuse_nonfinite(self._views(staged[0]), version)
        elif check is not None:
            check()
        elif progress is not None:
            progress.wait()
        if staged is None:  # weights on the CPU: from the snapshot, here
            with self.lock:
                shareable = (
                    bool(state)
                    and self._slots_for(self._plan(state), next(iter(state.values())).device)
                    and self.device.type != "cuda"
                )
                staged = self._write(state) if shareable else None
                if staged is not None:
                    self._mark_staged(version, *staged)
            if staged is None:
                self.not_shared += 1
                log.info(
                    "version %d is not shared over ipc (its tensors are not the slots'); the generators load "
                    "it from the store",
                    version,
                )
                return state_digest(state, self.digest)
        digest = self._announce(version, *staged, state)
        if progress is not None:
            progress.wait()  # the store copy is written from the snapshot: SnapshotFailed if its copy failed
        return digest

    def _announce(self, version: int, slot: int, seq: int, state: dict[str, torch.Tensor]) -> str:
        """The digest of ``version`` in ``slot``, announced in ``current`` unless the slot was rewritten
        meanwhile (then the digest of the snapshot ``state``, for the store copy alone)."""
        # outside the lock: stage() of a newer version may rewrite this slot meanwhile (seen below)
        digest = state_digest(self._views(slot), self.digest)
        if int(self.r.hget(self.keys.ipc, f"seq{slot}") or -1) != seq:
            self.superseded += 1
            log.info("version %d was superseded in its slot before it was announced there", version)
            return state_digest(state, self.digest)
        header_sha = hashlib.sha256(self.header).hexdigest()
        sig = (
            signing.collective_signature(self.key, self.keys.run_id, version, digest, header_sha)
            if self.key is not None
            else ""
        )
        self.r.hset(
            self.keys.ipc, "current", ipc.encode_current(version, slot, seq, self.epoch, digest, header_sha, sig)
        )
        self.shared += 1
        log.debug("version %d shared in slot %d (sequence %d)", version, slot, seq)
        return digest

    def close(self) -> None:
        """Stop sharing: the slots' description leaves Redis and the shared-memory segments are unlinked
        (generators that mapped them keep their mapping until they let go)."""
        with self.lock:
            if self.slots:
                self.r.delete(self.keys.ipc)
            for s in self.slots:
                shm = getattr(s, "_relay_shm", None)
                if shm is not None:  # the name goes (and this process's tracker forgets it); the views stay valid
                    try:
                        shm.unlink()
                    except FileNotFoundError:
                        pass  # unlinked by whoever restarted the run meanwhile
            self.slots = []

    def _unlink_previous(self) -> None:
        """A learner killed before :meth:`close` leaves its shared-memory segments behind: the one that
        restarts the run unlinks those its predecessor advertised."""
        for field in ("slot0", "slot1"):
            raw = self.r.hget(self.keys.ipc, field)
            if raw is None:
                continue
            try:
                import msgpack

                h = msgpack.unpackb(raw, raw=False)
            except (ValueError, msgpack.UnpackException):
                continue
            if isinstance(h, dict) and h.get("kind") == "shm":
                _unlink(str(h.get("name", "")))


class IpcSender(Sender):
    """``weights.transport = "ipc"``, learner side (learner/transports.py): the :class:`IpcSharer` stages each
    version into a shared slot on the device as soon as the weights are gathered, hands it to the
    generators on this host before the store copy is written, and unlinks its slots once closed."""

    name = "ipc"

    def __init__(self, ctx: SenderContext):
        super().__init__(ctx)
        self.handoff = IpcSharer(ctx.r, ctx.keys, ctx.announce_key, ctx.cfg.weights.digest).start()

    def stage(self, version: int, weights: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool) -> None:
        self.handoff.stage(version, weights, dtype, tied)

    def close(self) -> None:
        self.handoff.close()


def _unlink(name: str) -> None:
    from multiprocessing import shared_memory

    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()
    log.debug("unlinked shared-memory segment %s", name)
