"""The codec every wire message shares: msgpack maps with string keys (no pickle anywhere), numeric
arrays as ``{"dtype": "int32" | "float32", "data": <raw little-endian bytes>}`` so a producer in any
language can write them (docs/protocol.md has byte-level examples), and :class:`ProtocolError`, whose
short, stable ``reason`` code is used as a metric label.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1

# dtype names on the wire -> numpy little-endian dtypes.
WIRE_DTYPES = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4")}


class ProtocolError(ValueError):
    """A message that does not follow the protocol. ``reason`` is a stable short code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# ----------------------------------------------------------------------------------------------
# arrays


def encode_array(arr: np.ndarray, dtype: str) -> dict[str, Any]:
    """A 1-D array as ``{"dtype": name, "data": little-endian bytes}``."""
    return {"dtype": dtype, "data": np.ascontiguousarray(arr, dtype=WIRE_DTYPES[dtype]).tobytes()}


def decode_array(obj: Any, dtype: str, where: str) -> np.ndarray:
    if not isinstance(obj, dict) or set(obj) != {"dtype", "data"}:
        raise ProtocolError("bad_array", f"{where}: expected a map with keys dtype and data")
    if obj["dtype"] != dtype:
        raise ProtocolError("bad_dtype", f"{where}: dtype must be {dtype!r}, got {obj['dtype']!r}")
    data = obj["data"]
    if not isinstance(data, bytes):
        raise ProtocolError("bad_array", f"{where}: data must be bytes (msgpack bin)")
    itemsize = WIRE_DTYPES[dtype].itemsize
    if len(data) % itemsize:
        raise ProtocolError("bad_array", f"{where}: {len(data)} bytes is not a multiple of {itemsize}")
    return np.frombuffer(data, dtype=WIRE_DTYPES[dtype])


def get_field(m: dict, key: str, types: type | tuple, where: str = "group"):
    if key not in m:
        raise ProtocolError("missing_field", f"{where}.{key} is missing")
    v = m[key]
    if types is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, types) or (isinstance(v, bool) and types in (int, float)):
        raise ProtocolError("bad_type", f"{where}.{key} has type {type(v).__name__}")
    return v


def optional_field(m: dict, key: str, types: type, default):
    """An optional field: absent or nil gives ``default``; any other wrong type is rejected."""
    if m.get(key) is None:
        return default
    return get_field(m, key, types)


# Below this size a message is decoded by msgpack's C decoder in one call: its worst cases stay a few
# MiB (about 70 bytes of Python objects per byte for a message of empty maps), or ~32 MiB for nested
# array headers (1024 levels, each allocating MAX_ARRAY_LEN slots), freed before the next message.
# Larger messages are walked object by object within a budget of objects (_BoundedDecoder).
SMALL_MESSAGE = 64 << 10
# msgpack allocates a container's slots when it reads its header: these bound what a few bytes of
# headers can make it allocate. A group's samples (at most 256) and version runs stay far below.
MAX_ARRAY_LEN = 4096
MAX_MAP_LEN = 1024
MAX_DEPTH = 32


def unpack_limits(nbytes: int) -> dict:
    """msgpack's per-object limits for a message of ``nbytes``: a string or bin at most the message,
    arrays and maps at most MAX_ARRAY_LEN and MAX_MAP_LEN elements, no extension types."""
    return {"max_bin_len": nbytes, "max_str_len": nbytes, "max_ext_len": 0,
            "max_array_len": MAX_ARRAY_LEN, "max_map_len": MAX_MAP_LEN}


def object_budget(nbytes: int) -> int:
    """The most msgpack objects (containers and scalars; a str or bin is one) a message of ``nbytes``
    may hold: max(65536, nbytes / 256), so 65536 up to 16 MiB (never fewer than a SMALL_MESSAGE can
    hold, so both decoders accept the same messages); a group needs about 30 per sample and 3 per
    version run. The limits depend only on the message, so the broker and the learner agree."""
    return max(SMALL_MESSAGE, nbytes >> 8)


def unpack_map(data: bytes | memoryview) -> dict:
    """Decode one msgpack map (string keys) within :func:`unpack_limits` and :func:`object_budget`, so
    the memory it takes is bounded by the message size (about 2x: the objects made, the strings and
    bins copied out), whatever its shape."""
    try:
        if len(data) <= SMALL_MESSAGE:
            m = msgpack.unpackb(data, raw=False, strict_map_key=True, **unpack_limits(len(data)))
        else:
            m = _BoundedDecoder(data).decode()
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated exception types on garbage
        raise ProtocolError("not_msgpack", f"cannot decode msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(m, dict):
        raise ProtocolError("not_a_map", f"top level must be a map, got {type(m).__name__}")
    return m


class _BoundedDecoder:
    """msgpack decoded one object at a time: a container's header is read, then its elements, each
    counted against ``object_budget`` (``too_complex`` when exceeded, before the objects are made) and
    nested at most ``MAX_DEPTH`` deep. Scalars, strings and bins are decoded by msgpack itself."""

    def __init__(self, data: bytes | memoryview):
        self.data = memoryview(data).cast("B")
        self.u = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(len(data), 1),
                                  **unpack_limits(len(data)))
        self.u.feed(data)
        self.left = object_budget(len(data))

    def decode(self) -> Any:
        obj = self._next(0)
        if self.u.tell() != len(self.data):
            raise ProtocolError("not_msgpack", f"{len(self.data) - self.u.tell()} bytes after the message")
        return obj

    def _next(self, depth: int) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError("too_complex", "more msgpack objects than a message of this size may hold")
        if depth > MAX_DEPTH:
            raise ProtocolError("too_complex", f"nested deeper than {MAX_DEPTH}")
        first = self.data[self.u.tell()]
        if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):  # array
            return [self._next(depth + 1) for _ in range(self.u.read_array_header())]
        if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):  # map
            m = {}
            for _ in range(self.u.read_map_header()):
                key = self._next(depth + 1)
                if not isinstance(key, str):
                    raise ProtocolError("not_msgpack", f"map key of type {type(key).__name__}, not str")
                m[key] = self._next(depth + 1)
            return m
        return self.u.unpack()  # a scalar, str or bin: one object
