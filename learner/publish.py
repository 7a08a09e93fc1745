"""Publishing versions, off the learner's critical path (docs/weights.md).

The learner takes a *snapshot* of its weights (:func:`snapshot`: a CPU copy in the publication dtype,
checked finite), the only part it waits for, and hands it to :class:`BackgroundPublisher`, whose thread
writes the version into the weight store (:meth:`Publisher.write`: sharded safetensors, each file's
sha256 computed from the bytes written, the manifest, the rename), then announces it, while the
learner trains the next step.

- Order: one thread writes and announces, versions in the order they were handed over.
- Back-pressure: at most one version waits behind the one being written; a newer snapshot replaces a
  waiting one (skip to the newest: generators want the newest weights, not a queue of stale ones),
  and the skip is counted (``publish_skipped``).
- Crash safety: a version is announced only after its folder is sealed (renamed into place); a learner
  killed at any moment leaves at most an unannounced folder (skipped by :func:`first_version`) or a
  temporary one, never a half version announced.
- Failure: an error in the thread (a full disk) is raised in the learner at its next hand-over or
  :meth:`BackgroundPublisher.drain`: the learner fails as it did when publication was synchronous.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from broker.client.announcements import advertise_run, announce, record, signed_announcement
from broker.client.telemetry import emit_event, read_heartbeats
from broker.protocol import tensordigest, weightstore
from broker.protocol.keys import Keys
from broker.protocol.messages import Announcement
from broker.protocol.weightstore import ADAPTER_CONFIG, ADAPTER_FILE, INDEX, is_adapter_tensor
from broker.protocol.weights_config import WeightsConfig
from broker.protocol.signing import AnnounceSigner

log = logging.getLogger("relay.learner.publish")

SINGLE_FILE = "model.safetensors"


class NonFiniteWeights(ValueError):
    """Weights with a NaN or ±inf: never published (generators would serve garbage or crash)."""


def nonfinite_tensors(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors of ``state_dict`` that hold a NaN or ±inf. A sum first (no
    temporary the size of the tensor): finite sums, the common case, need nothing more. bf16 and fp32
    are summed in their own dtype (the same exponent range; 3.4x faster for bf16 than a float32 result
    on CPU), fp16 in float32 (its sums overflow at 65504)."""
    bad = []
    for k, v in state_dict.items():
        if not v.is_floating_point() or not v.numel():
            continue
        total = v.sum(dtype=torch.float32) if v.dtype == torch.float16 else v.sum()
        if bool(torch.isfinite(total)):  # a NaN or inf anywhere makes the sum non-finite
            continue
        if not bool(torch.isfinite(v).all()):  # a non-finite sum of finite weights (overflow) is not refused
            bad.append(k)
    return bad


def publication_dtype(dtype: str, bf16: bool) -> torch.dtype:
    """``weights.dtype``: ``auto`` is the training dtype (bf16 with ``learner.deepspeed.bf16``, else fp32)."""
    if dtype == "auto":
        return torch.bfloat16 if bf16 else torch.float32
    return getattr(torch, dtype)


def refuse_nonfinite(state: dict[str, torch.Tensor], version: int) -> None:
    """NonFiniteWeights naming the tensors of ``state`` that are not all finite, if any."""
    bad = nonfinite_tensors(state)
    if bad:
        raise NonFiniteWeights(
            f"version {version} not published: {len(bad)} weight(s) hold NaN or inf "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
        )


class SnapshotFailed(RuntimeError):
    """The copy of a snapshot being streamed (:class:`Progress`) failed before every tensor was filled."""


class Progress:
    """How far a snapshot being taken has got (:func:`fill`): the tensors filled so far. A snapshot
    handed over before it is filled (:meth:`BackgroundPublisher.submit` with ``progress``) is streamed:
    the collective broadcast sends each bucket as soon as its tensors are copied (:meth:`wait`), beside
    the copy the learner waits for, instead of after it."""

    def __init__(self):
        self._cv = threading.Condition()
        self._filled: set[str] = set()
        self._done = False
        self._error: BaseException | None = None

    def filled(self, name: str) -> None:
        with self._cv:
            self._filled.add(name)
            self._cv.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        """Every tensor is filled, or the copy failed with ``error``."""
        with self._cv:
            self._done, self._error = True, error
            self._cv.notify_all()

    def wait(self, names=None) -> None:
        """Until the tensors ``names`` (None: all) are filled; SnapshotFailed when the copy failed first."""
        with self._cv:
            self._cv.wait_for(lambda: self._done or (names is not None and self._filled.issuperset(names)))
            if self._error is not None:
                raise SnapshotFailed(f"the snapshot's copy failed: {self._error}") from self._error


def snapshot_buffers(
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    tied: bool = False,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Where a snapshot of ``state_dict`` goes (:func:`fill`): CPU tensors of the same shapes, floating-point
    ones in ``dtype``, without ``lm_head.weight`` when the embeddings are ``tied``. ``into`` (a previous
    snapshot done with, ``BackgroundPublisher.spare``, or the broadcaster's views into its flat buffer) is
    reused where name, shape and dtype match (no fresh gigabyte to allocate and fault in each version);
    its order comes first (the broadcast's order: buckets fill front to back). Weights on a GPU get
    their fresh buffers in one block of pinned memory (:func:`host_buffers`)."""
    into = into or {}
    wanted = {k: v for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}
    out, fresh = {}, {}
    for k in [*(k for k in into if k in wanted), *(k for k in wanted if k not in into)]:
        v = wanted[k]
        want = dtype if v.is_floating_point() else v.dtype
        old = into.get(k)
        reuse = old is not None and old.shape == v.shape and old.dtype == want
        out[k] = old if reuse else None  # the place in the order, filled below
        if not reuse:
            fresh[k] = (v.shape, want)
    out.update(host_buffers(fresh, pinned=any(v.is_cuda for v in wanted.values())))
    return out


ALIGN = 64  # bytes: every tensor of a pinned block starts aligned for any dtype


def host_buffers(shapes: dict[str, tuple], pinned: bool = False) -> dict[str, torch.Tensor]:
    """Empty CPU tensors ``{name: (shape, dtype)}``. ``pinned``: views into one block of page-locked
    memory, which a GPU copies into at full speed and without the learner waiting on each tensor
    (:func:`fill`): on an H200, 53 GB/s against 14.5 GB/s into reused pageable buffers (each copy
    synchronous and staged) and 1.6 GB/s into fresh ones (docs/benchmarks.md). One block, not one
    allocation per tensor: torch's pinned allocator rounds each allocation up to a power of two."""
    if not pinned:
        return {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in shapes.items()}
    offsets, total = {}, 0
    for k, (shape, dt) in shapes.items():
        offsets[k] = total
        total += -(-math.prod(shape) * dt.itemsize // ALIGN) * ALIGN
    block = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    return {
        k: block[offsets[k] : offsets[k] + math.prod(shape) * dt.itemsize].view(dt).view(shape)
        for k, (shape, dt) in shapes.items()
    }


def fill(
    buffers: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor], progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """Copy ``state_dict`` into ``buffers`` (:func:`snapshot_buffers`), in the buffers' order, telling
    ``progress`` each tensor filled (and the end, or the error). From a GPU into pinned buffers the
    copies are queued together, each reported filled when its own has landed."""
    try:
        landing = []  # (name, event) of copies from a GPU still in flight
        for k, dst in buffers.items():
            src = state_dict[k].detach()
            if src.is_cuda and dst.is_pinned():
                dst.copy_(src, non_blocking=True)
                landing.append((k, torch.cuda.Event()))
                landing[-1][1].record()
                continue
            dst.copy_(src)
            if progress is not None:
                progress.filled(k)
        for k, landed in landing:
            landed.synchronize()
            if progress is not None:
                progress.filled(k)
    except BaseException as e:
        if progress is not None:
            progress.finish(e)
        raise
    if progress is not None:
        progress.finish()
    return buffers


def snapshot(
    state_dict: dict[str, torch.Tensor],
    version: int,
    dtype: torch.dtype = torch.float32,
    tied: bool = False,
    into: dict[str, torch.Tensor] | None = None,
    check: bool = True,
) -> dict[str, torch.Tensor]:
    """The tensors to publish: a CPU copy of ``state_dict`` (:func:`snapshot_buffers`, :func:`fill`).
    NonFiniteWeights when one is not finite. The copy is what the learner waits for; its own weights
    change at the next step. ``check=False`` leaves the finiteness check to :meth:`Publisher.write` (off
    the learner's path: the publisher thread)."""
    state = fill(snapshot_buffers(state_dict, dtype, tied, into), state_dict)
    if check:
        refuse_nonfinite(state, version)
    return state


def plan_shards(state: dict[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most ``shard_bytes`` (in name order; a larger tensor
    gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for k in sorted(state):
        n = state[k].numel() * state[k].element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    return shards


# torch dtype -> safetensors' name for it
SAFETENSORS_DTYPE = {
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write ``tensors`` as one safetensors file (8-byte little-endian header length, the JSON header
    padded with spaces to 8 bytes, the tensors' bytes in name order) straight from their memory: no
    serialized copy in between, and the sha256 of the file computed from the same memory, in a thread
    beside the write. Returns that sha256 hex."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for k in sorted(tensors):
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    chunks = (len(head).to_bytes(8, "little"), head, *(_raw(tensors[k]) for k in sorted(tensors)))

    def sha256() -> str:
        h = hashlib.sha256()
        for chunk in chunks:
            h.update(chunk)
        return h.hexdigest()

    # the hash and the write read the same memory side by side (both release the GIL): the time of the
    # slower one, not of both
    with ThreadPoolExecutor(1, thread_name_prefix="relay-file-hash") as pool:
        digest = pool.submit(sha256)
        with open(path, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        return digest.result()


def write_safetensors(
    folder: Path,
    state: dict[str, torch.Tensor],
    shard_bytes: int,
    metadata: dict[str, str] | None = None,
    index: bool = False,
    threads: int = 1,
) -> dict[str, str]:
    """Write ``state`` into ``folder``: ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors``
    and the Hugging Face index when it exceeds ``shard_bytes`` (or always, with ``index``: a folder that
    also holds a LoRA adapter, whose file loaders that take every ``*.safetensors`` must leave out: vLLM
    reads only the files the index names). Each file is written straight from the tensors' memory and
    hashed as it is written (:func:`write_shard`): returns {file: sha256 hex} of the files written,
    never read back. ``threads``: shards written (and hashed) side by side (weights.hash_threads): one
    file's sha256 is sequential, so shards are what lets a large version's hashing use several cores."""
    shards = plan_shards(state, shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    meta = {"format": "pt", **(metadata or {})}
    with ThreadPoolExecutor(max(1, min(threads, len(shards))), thread_name_prefix="relay-shard") as pool:
        digests = dict(
            zip(
                names,
                pool.map(
                    lambda keys, name: write_shard(folder / name, {k: state[k] for k in keys}, meta), shards, names
                ),
            )
        )
    if len(shards) > 1 or index:
        weight_map = {k: name for name, keys in zip(names, shards) for k in keys}
        (folder / INDEX).write_text(
            json.dumps(
                {
                    "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                    "weight_map": weight_map,
                },
                indent=2,
                sort_keys=True,
            )
        )
    return digests


def first_version(latest_announced: int | None, store: str | Path) -> int:
    """The version a (re)starting learner publishes first: one past both the latest announcement and
    the newest snapshot in the store. A learner killed between sealing a snapshot (the rename) and
    announcing it leaves that version's folder behind unannounced; versions are immutable, so its
    number is skipped rather than written again."""
    stored = weightstore.list_versions(store)
    return max(latest_announced + 1 if latest_announced is not None else 0, stored[-1] + 1 if stored else 0)


def resumed_versions(saved: dict, latest_announced: int | None, store: str | Path) -> tuple[int, bool, bool]:
    """Where a learner resumed from a checkpoint goes on with the versions: ``(version, publish_now,
    unpublished)``. ``saved`` is the checkpoint's state: ``version`` (the last version handed to the
    publisher when it was written) and ``pending`` (its weights were to be published right after it, as
    ``version + 1``).

    When the newest version announced (and stored) is the checkpoint's own, the generators already
    serve the checkpoint's weights, or those of an earlier step of the same training (between two
    publications, as at any step of a run): the learner goes on from that number without publishing
    (``unpublished``: a step has changed the weights since, so the next due publication publishes).
    Otherwise its weights are published now, one past every number used (:func:`first_version`): a
    checkpoint whose publication was cut short (a learner killed between the two) publishes it as
    ``version + 1``; versions announced from steps the checkpoint does not hold (a learner killed after
    it) are left behind, so the generators leave weights that are no longer trained on."""
    version, pending = int(saved["version"]), bool(saved.get("pending", False))
    stored = weightstore.list_versions(store)
    newest = max(latest_announced if latest_announced is not None else -1, stored[-1] if stored else -1)
    if latest_announced is not None and latest_announced == newest == version + pending:
        return version + pending, False, bool(saved.get("unpublished", True)) and not pending
    return first_version(latest_announced, store), True, False


class Publisher:
    """Writes a snapshot into the weight store, seals it and announces it (:meth:`write`); :meth:`publish`
    is the synchronous whole (snapshot, then write), for tools and tests."""

    def __init__(
        self,
        r,
        keys: Keys,
        store: str,
        tokenizer,
        keep_versions: int,
        announce_key: AnnounceSigner | None = None,
        dtype: torch.dtype = torch.float32,
        shard_mb: float = WeightsConfig.model_fields["shard_mb"].default,
        broadcaster=None,
        digest: str = tensordigest.DEFAULT,
        versions_kept: int = 0,
        hash_threads: int = 1,
    ):
        self.r, self.keys, self.tokenizer = r, keys, tokenizer
        self.versions_kept = versions_kept  # announcements kept in Redis (learner.publish.keep_announcements; 0: all)
        self.broadcaster = (
            broadcaster  # the collective transport (learner/broadcast.py): broadcast before the store copy
        )
        self.announce_key = announce_key  # signs each announcement (None: unsigned, announce_auth insecure)
        self.store = Path(store).resolve()
        self.store.mkdir(parents=True, exist_ok=True)
        self.keep_versions = keep_versions
        self.dtype = dtype  # of the published floating-point tensors
        self.digest = digest  # the tensor digest's algorithm (weights.digest; the broadcaster has its own)
        self.shard_bytes = max(1, int(shard_mb * (1 << 20)))
        self.hash_threads = hash_threads  # shards written and hashed side by side (weights.hash_threads)
        self.heartbeat_ttl_s = 60.0
        self.url_for = None  # weights.transport http: version -> the base URL of its files (learner/weight_server.py)
        self._spare: dict | None = None  # publish(): the previous snapshot, its buffers reused
        # LoRA adapters published alone (learner.lora.publish): the adapter's adapter_config.json, and the
        # version that carried the base model with the base's tensor digest, once one is announced
        self.adapter_config: dict | None = None
        self.base_pin: tuple[int, str] | None = None

    def readvertise(self, latest: Announcement | None) -> None:
        """A learner resumed without publishing (:func:`resumed_versions`) stands behind the versions announced
        before it. With the http transport those name the previous learner's weight server (its port is gone):
        the latest version, and the version that carries the base model its adapter pins, are announced again
        with this learner's URL; the same versions, hashes and digests, so a generator that serves the latest
        loads nothing. With the other transports the announcements stand as they are."""
        if latest is None or self.url_for is None:
            return
        if latest.base is not None and latest.base != latest.version:
            base = signed_announcement(self.r, self.keys, latest.base, self.announce_key)
            if base is not None:
                record(self.r, self.keys, dataclasses.replace(base, url=self.url_for(base.version)), self.announce_key)
        announce(
            self.r,
            self.keys,
            dataclasses.replace(latest, url=self.url_for(latest.version)),
            self.announce_key,
            self.versions_kept,
        )
        log.info(
            "version %d announced again with this learner's weight server (%s)",
            latest.version,
            self.url_for(latest.version),
        )

    @property
    def needs_base(self) -> bool:
        """With adapters published alone: the next version must carry the base model too (no version of this
        publisher carrying it has been announced yet)."""
        return self.adapter_config is not None and self.base_pin is None

    def buffers(self, state_dict: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor] | None:
        """Fresh buffers for a :func:`snapshot` of ``state_dict`` (its ``into``) when there is no spare one:
        with the collective transport, views into the flat buffer the broadcaster sends as it lies (no copy
        between the snapshot and the wire); else None (the snapshot allocates its own)."""
        if self.broadcaster is None:
            return None
        return self.broadcaster.buffers(
            {k: v for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}, self.dtype
        )

    def publish(self, model, state_dict: dict[str, torch.Tensor], version: int) -> Announcement:
        """Seal and announce ``state_dict`` as ``version``; NonFiniteWeights (nothing written) when a
        weight is not finite. With the collective transport the snapshot is streamed: broadcast from
        another thread as it is copied, as the learner's publisher thread does."""
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        spare, self._spare = self._spare, None
        state = snapshot_buffers(state_dict, self.dtype, tied, spare or self.buffers(state_dict, tied))
        config = getattr(model, "config", None)
        try:
            if self.broadcaster is None:
                return self.write(config, fill(state, state_dict), version)  # checks finiteness first
            progress = Progress()
            with ThreadPoolExecutor(1, thread_name_prefix="relay-publish") as pool:
                written = pool.submit(self.write, config, state, version, progress)
                fill(state, state_dict, progress)
                return written.result()
        finally:
            self._spare = state  # written and announced (or refused): the next publish() reuses its buffers

    def write(
        self, config, state: dict[str, torch.Tensor], version: int, progress: Progress | None = None
    ) -> Announcement:
        """Write ``state`` (a :func:`snapshot`) as ``version`` with the model's ``config`` and the tokenizer,
        seal it, announce it (with the digest of its tensors), prune old versions. NonFiniteWeights, with
        nothing written or announced, when a weight is NaN or inf (checked here, in the publisher's thread,
        not while the learner waits). ``progress``: the snapshot is still being filled (:class:`Progress`);
        the broadcast follows the copy bucket by bucket, everything else waits for its end."""
        t0 = time.perf_counter()
        sent = self._check_and_send(state, version, progress)
        staging, known, digest, base = self._stage(config, state, version, sent)
        path, manifest_hash = weightstore.seal(self.store, version, staging, known)
        a = Announcement(
            version=version,
            hash=manifest_hash,
            path=str(path),
            digest=digest,
            url=self.url_for(version) if self.url_for else "",
            base=base[0] if base else None,
            base_digest=base[1] if base else "",
        )
        announce(self.r, self.keys, a, self.announce_key, self.versions_kept)
        advertise_run(self.r, self.keys, eos_token_id=self.tokenizer.eos_token_id)  # the run's EOS (protocol 7.11)
        emit_event(self.r, self.keys, "published", version=version, hash=manifest_hash, digest=digest)
        self._prune(base)
        log.debug("wrote and announced version %d in %.3fs (%d files)", version, time.perf_counter() - t0, len(known))
        return a

    def _check_and_send(self, state: dict[str, torch.Tensor], version: int, progress: Progress | None) -> str | None:
        """The finiteness check of ``state`` (NonFiniteWeights), and with the collective transport the
        broadcast: the tensor digest the broadcaster computed as it sent (None without one)."""

        def check() -> None:
            if progress is not None:
                progress.wait()
            refuse_nonfinite(state, version)

        # the collective transport: the generators get the tensors first (the broadcaster computes their digest
        # as it sends, and checks finiteness meanwhile: a refused version is aborted before its trailer, never
        # applied); the store copy follows, for late joiners, restarts and the audit
        if self.broadcaster is not None:
            return self.broadcaster.send(version, state, check=check, progress=progress)
        check()
        return None

    def _stage(
        self, config, state: dict[str, torch.Tensor], version: int, sent: str | None
    ) -> tuple[Path, dict, str, tuple[int, str] | None]:
        """The files of ``version`` written into its staging folder: the staging folder, the files' hashes,
        the tensor digest (``sent``: the broadcaster's, else computed beside the writes) and the base model
        the version's adapter applies to (its version and digest; None for a whole model)."""
        # a LoRA adapter (PEFT's file names) goes into adapter_model.safetensors; the rest is the model
        adapter = {k: v for k, v in state.items() if is_adapter_tensor(k)}
        model = {k: v for k, v in state.items() if k not in adapter} if adapter else state
        if adapter and self.adapter_config is None:
            raise ValueError(f"version {version} holds LoRA adapters but the publisher has no adapter_config")
        staging = weightstore.staging_dir(self.store, version)
        meta = {"version": str(version)}
        with ThreadPoolExecutor(2, thread_name_prefix="relay-digest") as pool:  # the hash passes beside the writes
            pending = pool.submit(tensordigest.state_digest, state, self.digest) if sent is None else None
            base_digest = pool.submit(tensordigest.state_digest, model, self.digest) if adapter and model else None
            known = {}
            if model:
                config.save_pretrained(staging)
                self.tokenizer.save_pretrained(staging)
                known.update(
                    write_safetensors(
                        staging, model, self.shard_bytes, meta, index=bool(adapter), threads=self.hash_threads
                    )
                )
            if adapter:
                (staging / ADAPTER_CONFIG).write_text(json.dumps(self.adapter_config, indent=1, sort_keys=True))
                known[ADAPTER_FILE] = write_shard(staging / ADAPTER_FILE, adapter, {"format": "pt", **meta})
            digest = sent if pending is None else pending.result()
            base_digest = base_digest.result() if base_digest is not None else None
        return staging, known, digest, self._base(version, bool(adapter), base_digest)

    def _base(self, version: int, adapter: bool, base_digest: str | None) -> tuple[int, str] | None:
        """The base model an ``adapter`` version applies to: itself when it carries the base too (its
        ``base_digest``), else the base pinned by the last such version."""
        if not adapter:
            return None
        if base_digest is not None:
            return (version, base_digest)
        if self.base_pin is None:
            raise ValueError(
                f"version {version} holds an adapter alone but no version with its base model was announced before it"
            )
        return self.base_pin

    def _prune(self, base: tuple[int, str] | None) -> None:
        """Old versions removed from the store, but for those served by generators seen recently (a dead
        generator's heartbeat does not pin) and the ``base`` the adapters that follow apply to."""
        now = time.time()
        in_use = {
            hb.version
            for hb in read_heartbeats(self.r, self.keys).values()
            if hb.last_seen is not None and now - hb.last_seen < self.heartbeat_ttl_s
        }
        if base is not None:  # the adapters that follow apply to this base: a (re)starting generator loads it
            self.base_pin = base
            in_use.add(base[0])
        weightstore.prune(self.store, self.keep_versions, {v for v in in_use if v is not None})


class BackgroundPublisher:
    """A thread that writes and announces the snapshots handed to it (:meth:`submit`), in order, at most
    one waiting (a newer one replaces it: ``skipped``). :meth:`drain` waits until everything handed over
    is announced; :meth:`close` drains and ends the thread. An error of the thread is raised by the next
    :meth:`submit` or :meth:`drain`."""

    def __init__(self, publisher: Publisher, config):
        self.publisher, self.config = publisher, config
        self._cv = threading.Condition()
        self._waiting: tuple[int, dict, Progress | None] | None = None
        self._writing: int | None = None  # the version being written
        self._error: BaseException | None = None
        self._closed = False
        self._skipped = 0  # skipped since the last take_skipped()
        self._refused = 0  # refused as non-finite since the last take_refused()
        self._spare: dict | None = None  # a snapshot written (or skipped) and done with: its buffers are reused
        self.announced: int | None = None  # the newest version this publisher announced
        self.last: Announcement | None = None
        self._thread = threading.Thread(target=self._loop, name="relay-publisher", daemon=True)
        self._thread.start()

    def submit(self, version: int, state: dict[str, torch.Tensor], progress: Progress | None = None) -> None:
        """Hand ``state`` over as ``version`` (greater than any handed over before); returns at once.
        ``progress``: ``state`` is still being filled (:func:`fill` with it, after this call): the thread
        streams it (the collective broadcast follows the copy) and writes the rest when it is done."""
        with self._cv:
            self._raise()
            if self._closed:
                raise RuntimeError("the publisher is closed")
            if self._waiting is not None:
                self._skipped += 1
                self._spare = self._waiting[1]
                log.info("publication behind: version %d skipped (version %d replaces it)", self._waiting[0], version)
            self._waiting = (version, state, progress)
            self._cv.notify_all()

    def spare(self) -> dict | None:
        """A snapshot the publisher is done with, for :func:`snapshot`'s ``into`` (None when there is none)."""
        with self._cv:
            s, self._spare = self._spare, None
            return s

    def take_refused(self) -> int:
        """Versions refused for non-finite weights since the last call (never announced; the learner adds
        them to its ``publish_refused_nonfinite`` count)."""
        with self._cv:
            n, self._refused = self._refused, 0
            return n

    def take_skipped(self) -> int:
        """Versions skipped since the last call (the learner adds them to its ``publish_skipped`` count)."""
        with self._cv:
            n, self._skipped = self._skipped, 0
            return n

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every version handed over is announced (or skipped). TimeoutError after ``timeout``."""
        with self._cv:
            if not self._cv.wait_for(
                lambda: self._error is not None or (self._waiting is None and self._writing is None), timeout
            ):
                raise TimeoutError(f"publication of version {self._writing} still running after {timeout}s")
            self._raise()

    def close(self) -> None:
        self.drain()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"publishing weights failed: {self._error}") from self._error

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._waiting is not None or self._closed)
                if self._waiting is None:
                    return
                (version, state, progress), self._waiting = self._waiting, None
                self._writing = version
            try:
                a = self.publisher.write(self.config, state, version, progress)
            except NonFiniteWeights as e:  # nothing announced; the generators keep the previous version
                log.error("%s; generators keep version %s", e, self.announced)
                with self._cv:
                    self._refused += 1
                    self._writing, self._spare = None, state
                    del state
                    self._cv.notify_all()
                continue
            except BaseException as e:  # raised in the learner by its next submit() or drain()
                log.error("publishing version %d failed: %s", version, e)
                with self._cv:
                    self._error, self._writing = e, None
                    self._cv.notify_all()
                return
            with self._cv:
                self.announced, self.last, self._writing, self._spare = version, a, None, state
                del state
                self._cv.notify_all()
