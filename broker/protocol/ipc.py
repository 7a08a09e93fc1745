"""The ``ipc`` weight transport's contract (learner/ipc.py -> generators/ipc_receive.py): versions handed
from the learner's leader to generators on the same host through shared memory, never copied through a
socket. Weights on a GPU travel through CUDA IPC (the learner's device memory mapped into the
generator's process: a device-to-device copy); weights on the CPU through a POSIX shared-memory segment.

The learner keeps two *slots*, flat buffers that each hold one version laid out as the collective
transport lays it out (broker/protocol/collective.py ``plan``: name order, 64-byte aligned offsets, in
the publication dtype). It fills the slot the newest announced version is not in, so a generator can
copy version v while v+1 is written. Everything else lies in one Redis hash, ``Keys.ipc``:

- ``epoch``: incremented each time the slots are allocated (a learner restart maps new ones);
- ``header``: the layout (the collective header of version 0), the same for both slots;
- ``slot0``, ``slot1``: msgpack maps describing each buffer (:func:`export_buffer`: plain integers and
  bytes, never a pickled object);
- ``seq0``, ``seq1``: each slot's sequence number, a seqlock: the learner makes it odd before it
  writes the slot and even once the write has landed;
- ``staged``: JSON ``{"version", "slot", "seq", "epoch"}``: the newest version written into a slot, before
  the learner has checked and digested it. A hint, never signed and never applied on its own: a generator
  may start copying (and digesting) it while the learner digests it too, and uses its copy only when a
  ``current`` entry with the same version, slot, sequence number and epoch follows;
- ``current``: JSON ``{"version", "slot", "seq", "epoch", "digest", "header_sha256", "sig"}``: the
  newest version, the slot and sequence number it lies under, its tensor digest
  (broker/protocol/tensordigest.py, the one the announcement carries) and the learner's Ed25519
  signature over them (signing.py ``collective_signature``: the same statement the collective
  trailer makes).

A generator reads ``current``, checks that ``seq<slot>`` still equals its ``seq``, copies the slot into
a buffer of its own, and reads ``seq<slot>`` again: a change means the learner rewrote the slot during
the copy (superseded, discarded, never refused). Then it checks the signature and the digest of the
bytes it copied against the signed digest; a mismatch is refused and flagged like a bad hash. Only the
generator's own copy is ever applied.
"""

from __future__ import annotations

import json

import msgpack

CUDA_FIELDS = ("device", "handle", "size", "offset", "ref_handle", "ref_offset", "event_handle", "event_sync")


class IpcError(ValueError):
    """A slot description or a ``current`` entry that cannot be used."""


def export_buffer(flat) -> bytes:
    """What another process on this host needs to map ``flat`` (a 1-D uint8 tensor owning its storage:
    CUDA memory, or a POSIX shared-memory segment whose ``SharedMemory`` is ``flat._relay_shm``),
    msgpack-encoded."""
    if flat.device.type == "cuda":
        fields = flat.untyped_storage()._share_cuda_()
        return msgpack.packb(
            {"kind": "cuda", "numel": flat.numel(), **dict(zip(CUDA_FIELDS, fields))}, use_bin_type=True
        )
    return msgpack.packb({"kind": "shm", "name": flat._relay_shm.name, "numel": flat.numel()}, use_bin_type=True)


def open_buffer(raw: bytes):
    """``(flat, keep)``: the uint8 tensor :func:`export_buffer` described, mapped in this process, and the
    object that must stay alive while it is used. IpcError when the description is malformed."""
    import torch

    try:
        h = msgpack.unpackb(raw, raw=False)
        kind, numel = h["kind"], int(h["numel"])
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
        raise IpcError(f"malformed slot description: {e}") from None
    if kind == "cuda":
        try:
            args = [h[f] for f in CUDA_FIELDS]
        except KeyError as e:
            raise IpcError(f"slot description lacks {e}") from None
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(*args)
        if storage.nbytes() < numel:
            raise IpcError(f"slot of {storage.nbytes()} bytes, {numel} announced")
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{args[0]}").set_(storage, 0, (numel,), (1,))
        return flat, storage
    if kind != "shm":
        raise IpcError(f"slot kind {kind!r} (cuda or shm)")
    from multiprocessing import resource_tracker, shared_memory

    shm = shared_memory.SharedMemory(name=str(h["name"]))
    # the learner owns the segment and unlinks it; this process's tracker must not do it at exit
    resource_tracker.unregister(shm._name, "shared_memory")
    if shm.size < numel:
        shm.close()
        raise IpcError(f"segment {h['name']} of {shm.size} bytes, {numel} announced")
    return torch.frombuffer(shm.buf, dtype=torch.uint8, count=numel) if numel else torch.empty(
        0, dtype=torch.uint8
    ), shm


def shared_buffer(nbytes: int, device, name: str):
    """A fresh flat uint8 buffer another process can map: CUDA memory on ``device``, or a shared-memory
    segment called ``name`` (kept as ``flat._relay_shm``; its owner unlinks it)."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, nbytes))
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    flat._relay_shm = shm
    return flat


def encode_current(version: int, slot: int, seq: int, epoch: int, digest: str, header_sha256: str, sig: str) -> bytes:
    return json.dumps(
        {
            "version": version,
            "slot": slot,
            "seq": seq,
            "epoch": epoch,
            "digest": digest,
            "header_sha256": header_sha256,
            "sig": sig,
        },
        separators=(",", ":"),
    ).encode()


def encode_staged(version: int, slot: int, seq: int, epoch: int) -> bytes:
    return json.dumps({"version": version, "slot": slot, "seq": seq, "epoch": epoch}, separators=(",", ":")).encode()


def parse_staged(raw: bytes) -> dict:
    """The fields of a ``staged`` entry; IpcError when it is malformed."""
    return parse_current(raw, staged=True)


def parse_current(raw: bytes, staged: bool = False) -> dict:
    """The fields of a ``current`` entry; IpcError when it is malformed."""
    try:
        c = json.loads(raw)
        out = {"version": int(c["version"]), "slot": int(c["slot"]), "seq": int(c["seq"]), "epoch": int(c["epoch"])}
        if not staged:
            out.update(digest=str(c["digest"]), header_sha256=str(c["header_sha256"]), sig=str(c.get("sig", "")))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise IpcError(f"malformed {'staged' if staged else 'current'} entry: {e}") from None
    if out["slot"] not in (0, 1) or out["seq"] % 2:
        raise IpcError(f"{'staged' if staged else 'current'} entry names slot {out['slot']} at sequence {out['seq']}")
    return out
