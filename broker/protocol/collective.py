"""The wire format of the ``collective`` weight transport (learner/broadcast.py -> generators/weight_receive.py).

A version travels over a 2-rank torch.distributed group (the learner's leader is rank 0, one generator
rank 1) as four broadcasts from rank 0, in this order:

1. ``header``: a length-prefixed JSON object (``blob``: an int64 tensor ``[n]``, then ``n`` uint8 bytes)::

       {"kind": "weights", "version": int, "total": int,        # bytes of the flat buffer
        "bucket_bytes": int,                                     # every bucket but the last has this size
        "digest": "xxh3" | "sha256",                             # the tensor digest's algorithm (absent: sha256)
        "tensors": [[name, dtype, [sizes...], offset, nbytes], ...]}   # in name order

2. ``buckets``: the flat uint8 buffer that holds every tensor at its offset (little-endian, C order;
   offsets aligned to :data:`ALIGN` bytes, the gaps zero), sliced in ``bucket_bytes`` pieces.
3. ``trailer``: a length-prefixed JSON object ``{"version", "digest", "header_sha256", "sig"}``:
   the tensor digest (broker/protocol/tensordigest.py, the same one the announcement carries) and the
   learner's Ed25519 signature over them (broker/protocol/signing.py ``collective_signature``).
   A version the learner refused while it was on the wire (a weight NaN or inf) ends with an empty
   ``digest`` and ``"abort": reason`` (signed the same way): every member discards it.

Nothing received is applied before the trailer's signature checks (the learner's Ed25519 key,
verified with the run's public key) and the digest of the bytes received equals the signed digest:
whoever can reach the rendezvous port cannot inject weights, and a bucket altered in flight is refused.
Only JSON and raw tensor bytes travel (no pickle).

Who may receive: the **rendezvous** (learner/rendezvous.py serves, generators/weight_receive.py joins),
one TCP connection per generator made of frames (a 4-byte big-endian length, then a msgpack map; at
most :data:`MAX_JOIN_FRAME` bytes before the join is accepted, :data:`MAX_FRAME` after):

1. learner: ``{"kind": "challenge", "v": 1, "challenge": <64 hex>}`` (fresh for each connection);
2. generator: ``{"kind": "join", "generator": id, "session": hex, "nonce": <64 hex>, "proof": hex}``,
   ``proof`` = weightauth.join_proof(weights key, run id, challenge, nonce, generator, session);
   a wrong proof (or none, or too late) closes the connection without a word;
3. learner: ``{"kind": "refused", "reason": str}`` (an id already connected, the group full) or
   ``{"kind": "accepted", "ticket": int, "proof": hex}`` (weightauth.accept_proof: the generator
   checks it is the learner);
4. the gloo group is built, its store being this connection: the generator sends
   ``{"op": "set"|"get"|"wait"|"check"|"add", ...}``, the learner answers ``{"ok": true, "value": ...}``
   or ``{"ok": false, "error": str}``; then ``{"op": "ready"}``;
5. the learner broadcasts 32 random bytes over the new group; the generator answers
   ``{"op": "pair", "mac": weightauth.join_proof(key, run id, "pair", <those bytes, hex>, generator,
   session)}``; the learner's ``{"kind": "member"}`` makes it a member;
6. the connection stays open, silent, as long as the membership: either side closing it ends it.
"""

from __future__ import annotations

import datetime
import json
import logging
import struct
from dataclasses import dataclass

import msgpack

ALIGN = 64  # every tensor starts at a multiple of this many bytes of the flat buffer (any dtype can view it)
MAX_BLOB = 64 << 20  # a header or trailer longer than this is refused (a peer that is not the learner)
DTYPE_SIZES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


class CollectiveError(ValueError):
    """A malformed header or trailer; ``reason`` is what the generator reports (the ``refused`` event)."""

    def __init__(self, message: str, reason: str = "bad_collective_header"):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: str  # torch's name without "torch." (tensordigest.py)
    shape: tuple[int, ...]
    offset: int  # first byte in the flat buffer
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Where each tensor lies in the flat buffer and how the buffer is cut into buckets."""

    slots: tuple[Slot, ...]
    total: int
    bucket_bytes: int
    digest: str = "sha256"  # the tensor digest's algorithm (tensordigest.py)

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """(start, end) of each bucket: ``bucket_bytes`` each, the last one shorter; none when empty."""
        return [(s, min(s + self.bucket_bytes, self.total)) for s in range(0, self.total, self.bucket_bytes)]

    def completed_by(self, start: int, end: int) -> list[Slot]:
        """The tensors complete once the bucket [start, end) has landed (buckets land in order): those
        whose end lies in (start, end]; an empty tensor at offset 0 goes with the first bucket."""
        return [
            s for s in self.slots if start < s.offset + s.nbytes <= end or (start == 0 and s.offset + s.nbytes == 0)
        ]

    def header(self, version: int) -> bytes:
        return json.dumps(
            {
                "kind": "weights",
                "version": version,
                "total": self.total,
                "bucket_bytes": self.bucket_bytes,
                "digest": self.digest,
                "tensors": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.slots],
            },
            separators=(",", ":"),
        ).encode()


def plan(tensors: list[tuple[str, str, tuple[int, ...]]], bucket_bytes: int, digest: str = "sha256") -> Layout:
    """The layout of ``(name, dtype, shape)`` tensors: name order, each at an ALIGN-aligned offset;
    ``digest``: the algorithm of the tensor digest the trailer will carry."""
    from broker.protocol.tensordigest import ALGORITHMS

    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}")
    if digest not in ALGORITHMS:
        raise ValueError(f"digest algorithm {digest!r} is not one of {', '.join(ALGORITHMS)}")
    slots, off = [], 0
    names = set()
    for name, dtype, shape in sorted(tensors):
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} cannot travel (one of {sorted(DTYPE_SIZES)})")
        n = DTYPE_SIZES[dtype]
        for d in shape:
            n *= int(d)
        slots.append(Slot(name, dtype, tuple(int(d) for d in shape), off, n))
        off = -(-(off + n) // ALIGN) * ALIGN
    total = slots[-1].offset + slots[-1].nbytes if slots else 0
    return Layout(tuple(slots), total, bucket_bytes, digest)


def parse_header(raw: bytes, max_total: int) -> tuple[int, Layout]:
    """(version, layout) of a received header; CollectiveError when it is malformed, overlaps, or
    announces more than ``max_total`` bytes."""
    try:
        h = json.loads(raw)
        if h.get("kind") != "weights":
            raise CollectiveError(f"header kind {h.get('kind')!r} is not 'weights'")
        version, total, bucket_bytes = int(h["version"]), int(h["total"]), int(h["bucket_bytes"])
        digest = str(h.get("digest", "sha256"))
        entries = [(str(n), str(d), tuple(int(x) for x in shape)) for n, d, shape, _, _ in h["tensors"]]
        got = [(int(o), int(b)) for _, _, _, o, b in h["tensors"]]
    except CollectiveError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CollectiveError(f"malformed header: {e}") from None
    if not 0 <= total <= max_total:
        raise CollectiveError(f"header announces {total} bytes (at most {max_total})")
    try:
        layout = plan(entries, bucket_bytes, digest)
    except ValueError as e:
        raise CollectiveError(f"malformed header: {e}") from None
    if layout.total != total or [(s.offset, s.nbytes) for s in layout.slots] != got:
        raise CollectiveError("header layout is not the canonical one for its tensors")
    return version, layout


def parse_trailer(raw: bytes) -> dict:
    try:
        t = json.loads(raw)
        out = {
            "version": int(t["version"]),
            "digest": str(t["digest"]),
            "header_sha256": str(t["header_sha256"]),
            "sig": str(t.get("sig", "")),
            "abort": str(t.get("abort", "")),
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CollectiveError(f"malformed trailer: {e}", "bad_collective_trailer") from None
    return out


# -- the rendezvous's frames (learner/rendezvous.py, generators/weight_receive.py) ---------------

RENDEZVOUS_VERSION = 1
MAX_JOIN_FRAME = 4096  # a challenge or a join: a few hundred bytes
MAX_FRAME = 1 << 20  # after the join: the gloo group's store traffic (addresses: hundreds of bytes)
_LENGTH = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that is too long or not a msgpack map."""


def frame(msg: dict) -> bytes:
    """``msg`` as one frame: its length (4 bytes, big-endian), then the msgpack map."""
    body = msgpack.packb(msg, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


def _decode(body: bytes) -> dict:
    from broker.protocol.codec import ProtocolError, unpack_map

    try:
        return unpack_map(body)  # bounded by the frame's size, whatever its shape
    except ProtocolError as e:
        raise FrameError(f"a frame that is not a msgpack map: {e}") from None


class FrameReader:
    """Frames out of a byte stream fed in pieces (a non-blocking socket): :meth:`feed`, then :meth:`next`
    until None. FrameError for a frame longer than ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.buf = max_bytes, bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > self.max_bytes + _LENGTH.size:
            raise FrameError(f"more than {self.max_bytes} bytes before a frame ended")

    def next(self) -> dict | None:
        if len(self.buf) < _LENGTH.size:
            return None
        (n,) = _LENGTH.unpack_from(self.buf)
        if n > self.max_bytes:
            raise FrameError(f"a frame of {n} bytes (at most {self.max_bytes})")
        if len(self.buf) < _LENGTH.size + n:
            return None
        body = bytes(self.buf[_LENGTH.size : _LENGTH.size + n])
        del self.buf[: _LENGTH.size + n]
        return _decode(body)


def read_frame(sock, max_bytes: int = MAX_FRAME) -> dict:
    """One frame from a blocking socket (its timeout applies); ConnectionError when it closes first."""
    (n,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size))
    if n > max_bytes:
        raise FrameError(f"a frame of {n} bytes (at most {max_bytes})")
    return _decode(_read_exactly(sock, n))


def _read_exactly(sock, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the rendezvous connection closed")
        out += chunk
    return bytes(out)


def keepalive(sock, idle_s: int = 10, interval_s: int = 5, count: int = 3) -> None:
    """TCP keep-alive on ``sock``: a peer whose machine is gone is seen in about idle + interval x count
    seconds (a process that exits closes its connections at once)."""
    import socket

    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", count)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


# -- the torch side (imported lazily: this module stays importable without torch) ----------------


def gloo_group(store, prefix: str, rank: int, host: str, timeout_s: float):
    """A 2-rank gloo group under ``prefix`` of ``store`` (blocks until the other rank builds its side)."""
    import torch.distributed

    opts = torch.distributed.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    loopback = host in ("127.0.0.1", "localhost", "::1")
    opts._devices = [
        torch.distributed.ProcessGroupGloo.create_device(hostname="127.0.0.1")
        if loopback
        else torch.distributed.ProcessGroupGloo.create_default_device()
    ]
    return torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore(prefix, store), rank, 2, opts)


def send_blob(pg, data: bytes, timeout: datetime.timedelta) -> list:
    """Broadcast a length-prefixed byte string from rank 0 (async; the works to wait on)."""
    import torch

    n = torch.tensor([len(data)], dtype=torch.int64)
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return [pg.broadcast(n, 0, timeout), pg.broadcast(body, 0, timeout)]


def abort_group(pg) -> None:
    """Tear a member's group down (its peer's pending receive fails at once; it rejoins)."""
    for name in ("abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except RuntimeError as e:
            logging.getLogger("relay.collective").debug("%s of a member group failed: %s", name, e)


class BucketHasher:
    """The digest entries of a layout's tensors, hashed bucket by bucket as each bucket is filled (the
    learner) or lands (a generator), while its bytes are still warm in the cache: each tensor has its
    own incremental hash, fed the part of it in each bucket. Call :meth:`add` for each bucket, in order,
    then :meth:`entries`. ``pools``: single-thread executors (each runs its jobs in order); a tensor's
    parts and its final entry always go to the same one."""

    def __init__(self, layout: Layout, flat, pools: list):
        from broker.protocol.tensordigest import hasher

        self.layout, self.flat, self.pools = layout, flat, pools
        self.hashes = [hasher(layout.digest) for _ in layout.slots]
        self.finals: list = []

    def _update(self, i: int, start: int, end: int) -> None:
        self.hashes[i].update(self.flat[start:end].numpy())

    def _entry(self, i: int) -> tuple[str, bytes]:
        from broker.protocol.tensordigest import tensor_entry_from_hash

        s = self.layout.slots[i]
        return tensor_entry_from_hash(s.name, s.dtype, s.shape, self.hashes[i].digest())

    def add(self, start: int, end: int) -> None:
        """Bucket [start, end) is in the buffer: hash the parts of the tensors in it; the tensors it
        completes get their entries."""
        for i, s in enumerate(self.layout.slots):
            lo, hi = max(start, s.offset), min(end, s.offset + s.nbytes)
            pool = self.pools[i % len(self.pools)]
            if lo < hi:
                pool.submit(self._update, i, lo, hi)
            if start < s.offset + s.nbytes <= end or (start == 0 and s.offset + s.nbytes == 0):
                self.finals.append(pool.submit(self._entry, i))

    def entries(self) -> list[tuple[str, bytes]]:
        """Every tensor's entry (each bucket added): waits for the hashing still under way."""
        return [f.result() for f in self.finals]
