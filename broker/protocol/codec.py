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


# msgpack allocates a container's slots when it reads its header: these bound what a few bytes of
# headers can make it allocate. A group's samples (at most 256) and version runs stay far below.
MAX_ARRAY_LEN = 4096
MAX_MAP_LEN = 1024


def unpack_limits(nbytes: int) -> dict:
    """msgpack's per-object limits for a message of ``nbytes``: a string or bin at most the message,
    arrays and maps at most MAX_ARRAY_LEN and MAX_MAP_LEN elements, no extension types."""
    return {
        "max_bin_len": nbytes,
        "max_str_len": nbytes,
        "max_ext_len": 0,
        "max_array_len": MAX_ARRAY_LEN,
        "max_map_len": MAX_MAP_LEN,
    }


def object_budget(nbytes: int) -> int:
    """The most msgpack objects (containers and their elements; a str or bin is one) a message of
    ``nbytes`` may hold: max(65536, nbytes / 256), so 65536 up to 16 MiB; a group needs about 30 per
    sample and 3 per version run. The limits depend only on the message, so the broker and the learner
    agree."""
    return max(1 << 16, nbytes >> 8)


class _Budget:
    """Counts the objects msgpack's C decoder makes, through its hooks (called once per array and per
    map, as each is completed): a container counts one plus its elements (a map's keys and values),
    so every object but the top level is counted once. Past the budget decoding stops
    (``too_complex``), with at most one container (MAX_ARRAY_LEN elements) made beyond it."""

    def __init__(self, nbytes: int):
        self.left = object_budget(nbytes)

    def _spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise ProtocolError("too_complex", "more msgpack objects than a message of this size may hold")

    def list_hook(self, xs: list) -> list:
        self._spend(1 + len(xs))
        return xs

    def object_hook(self, m: dict) -> dict:
        self._spend(1 + 2 * len(m))
        return m


def unpack_map(data: bytes | memoryview) -> dict:
    """Decode one msgpack map (string keys) by msgpack's C decoder within :func:`unpack_limits` and
    :func:`object_budget`, so the memory it takes is bounded by the message size (about 2x: the
    objects made, the strings and bins copied out), whatever its shape."""
    budget = _Budget(len(data))
    try:
        m = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            list_hook=budget.list_hook,
            object_hook=budget.object_hook,
            **unpack_limits(len(data)),
        )
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated exception types on garbage
        raise ProtocolError("not_msgpack", f"cannot decode msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(m, dict):
        raise ProtocolError("not_a_map", f"top level must be a map, got {type(m).__name__}")
    return m
