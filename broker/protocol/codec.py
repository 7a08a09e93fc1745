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


def unpack_limits(max_bytes: int) -> dict:
    """msgpack's per-object limits for a message of at most ``max_bytes``: a string or bin at most the
    message, an array at most ``max_bytes / 4096`` elements (4096 at the default 16 MiB; a group's samples
    and version runs stay far below), a map a quarter of that. msgpack allocates a container's slots when
    it reads its header, so these bound what a few bytes of nested headers can make it allocate."""
    return {"max_bin_len": max_bytes, "max_str_len": max_bytes, "max_ext_len": 0,
            "max_array_len": max(256, max_bytes >> 12), "max_map_len": max(64, max_bytes >> 14)}


def unpack_map(data: bytes | memoryview, max_bytes: int | None = None) -> dict:
    """Decode one msgpack map (string keys), within :func:`unpack_limits` of ``max_bytes`` (default: the
    data's own length)."""
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True, **unpack_limits(max_bytes or max(len(data), 1024)))
    except Exception as e:  # msgpack raises several unrelated exception types on garbage
        raise ProtocolError("not_msgpack", f"cannot decode msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(m, dict):
        raise ProtocolError("not_a_map", f"top level must be a map, got {type(m).__name__}")
    return m
