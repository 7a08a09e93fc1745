"""The group message: a scored group of completions of one prompt (generator -> broker -> learner),
the unit of transport and of training. :func:`decode_group` is where every group is validated:
anything wrong raises :class:`ProtocolError` with a stable ``reason`` (docs/protocol.md section 4).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

import msgpack
import msgspec
import numpy as np

from broker.protocol.codec import (
    MAX_ARRAY_LEN,
    MAX_MAP_LEN,
    SCHEMA_VERSION,
    WIRE_DTYPES,
    ProtocolError,
    decode_array,
    get_field,
    object_budget,
    optional_field,
    unpack_map,
)

FINISH_REASONS = ("stop", "length")
REWARD_STATUSES = ("ok", "failed")
FLOAT32_MAX = float(np.finfo(np.float32).max)
# the largest reward magnitude a group may carry (docs/protocol.md 3.2, reason reward_range): far beyond any
# reward in use (0..1 for the built-in plugins), and small enough that a batch's sums of squared rewards
# (advantages, whitening) stay finite in float32. The reward service fails a plugin's score beyond it.
REWARD_LIMIT = 1e6
# a message the broker does not decode whole (too_large) has its group_id read from this many first bytes
HEAD_BYTES = 4096


# ----------------------------------------------------------------------------------------------
# version runs: per-token policy versions in run-length form, [[version, count], ...]


def versions_to_runs(versions: list[int] | np.ndarray) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in versions:
        v = int(v)
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def runs_to_versions(runs: list[list[int]]) -> np.ndarray:
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.full(n, v, dtype=np.int64) for v, n in runs])


# trainable runs: which tokens of a multi-turn sample the model sampled (1) and which are context (0: a
# tool's output, the chat template's turn markers), in the same run-length form, [[1, 5], [0, 4], [1, 3]]


def trainable_to_runs(mask: np.ndarray | list[int]) -> list[list[int]]:
    return versions_to_runs(mask)


def runs_to_trainable(runs: list[list[int]]) -> np.ndarray:
    return runs_to_versions(runs).astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# group


@dataclass
class Sample:
    """One completion of a group.

    completion_ids: int32 [T] token ids the generator sampled (EOS included when finished).
    logprobs:       float32 [T] behaviour log-prob of each sampled token under the distribution
                    actually sampled from (temperature / top-p / top-k applied).
    version_runs:   the policy version of each token in run-length form [[version, count], ...];
                    counts sum to T.
    finish_reason:  "stop" (EOS) or "length" (max_tokens reached).
    reward:         the score, or None when reward_status is "failed".
    reward_status:  "ok" or "failed"; a failed reward is never a silent 0.
    reward_details: free-form map of named sub-scores / failure reason from the reward service.
    trainable:      uint8 [T] or None. A multi-turn sample (an episode: the model's turns with a tool's or
                    the environment's replies between them, docs/agents.md) marks each token 1 when the
                    model sampled it and 0 when it is context the model only read; the learner trains the
                    1s only. None: every token was sampled (a single-turn completion). On the wire:
                    ``trainable_runs``, absent for single-turn samples.
    """

    completion_ids: np.ndarray
    logprobs: np.ndarray
    version_runs: list[list[int]]
    finish_reason: str
    reward: float | None = None
    reward_status: str = "ok"
    reward_details: dict[str, Any] = field(default_factory=dict)
    trainable: np.ndarray | None = None

    @property
    def versions(self) -> np.ndarray:
        return runs_to_versions(self.version_runs)

    @property
    def min_version(self) -> int:
        return min((v for v, _ in self.version_runs), default=0)

    @property
    def num_trainable(self) -> int:
        """The tokens the model sampled (all of them for a single-turn sample)."""
        return len(self.completion_ids) if self.trainable is None else int(self.trainable.sum())


@dataclass
class Group:
    """A group of n completions of one prompt, scored. The unit of transport and of training.

    group_id:       unique string; the broker de-duplicates on it (resends are safe).
    run_id:         the run this group belongs to.
    prompt_id:      id of the prompt (the prompts-stream entry id or a dataset id).
    prompt_ids:     int32 [P] prompt token ids.
    samples:        the n completions.
    generator_id:   id of the generator replica that produced it.
    weight_version: the version the generator served when it started the group.
    weight_hash:    the manifest hash of that version; the broker rejects a group whose hash is not the
                    one announced for weight_version (``weight_hash``).
    sampling:       sampling parameters: temperature, top_p, top_k, max_tokens, n.
    task:           the task / reward plugin name.
    reference:      the reference answer given to the reward (may be empty).
    created_at / scored_at / sent_at: unix timestamps (float seconds).
    """

    group_id: str
    run_id: str
    prompt_id: str
    prompt_ids: np.ndarray
    samples: list[Sample]
    generator_id: str
    weight_version: int
    weight_hash: str
    sampling: dict[str, Any]
    task: str = ""
    reference: str = ""
    created_at: float = field(default_factory=time.time)
    scored_at: float = 0.0
    sent_at: float = 0.0

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    @property
    def min_version(self) -> int:
        """The oldest version that sampled any of the group's tokens (0 for a group without samples)."""
        lo = None
        for s in self.samples:  # inline loops: the broker asks this of every group, and a generator
            for v, _ in s.version_runs:  # expression per sample cost three times as much
                if lo is None or v < lo:
                    lo = v
        return 0 if lo is None else lo

    @property
    def max_version(self) -> int:
        """The newest version that sampled any of the group's tokens (0 for a group without samples)."""
        hi = 0
        for s in self.samples:
            for v, _ in s.version_runs:
                if v > hi:
                    hi = v
        return hi

    @property
    def num_tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.samples)


def _wire_data(arr: np.ndarray, dtype: np.dtype) -> memoryview:
    """The bytes of a 1-D array in the wire dtype: the array's own memory when it already is that dtype
    and contiguous (the encoder then copies it once, into the message). ``is``: numpy's built-in
    dtypes are singletons, and anything else is converted."""
    if arr.dtype is dtype:
        data = arr.data
        if data.c_contiguous:
            return data
    return np.ascontiguousarray(arr, dtype=dtype).data


def _numpy_scalar(obj: Any) -> Any:
    """Numpy scalars (a reward computed with numpy) are written as the Python numbers they hold."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} in a group message")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_numpy_scalar)
_I32, _F32 = WIRE_DTYPES["int32"], WIRE_DTYPES["float32"]


# What the encoder writes, field for field in the order of docs/protocol.md section 4: msgspec writes a
# Struct as the map of its fields (about a third faster than building the same dicts), and omits
# ``trainable_runs`` when it is None (a single-turn sample).
class _OutArray(msgspec.Struct, gc=False):
    dtype: str
    data: memoryview


class _OutSample(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    completion_ids: _OutArray
    logprobs: _OutArray
    version_runs: list
    trainable_runs: Union[list, None] = None  # the only field with a default: the only one ever omitted
    finish_reason: str
    reward: Any
    reward_status: str
    reward_details: dict


class _OutGroup(msgspec.Struct, gc=False):
    schema: int
    kind: str
    group_id: str
    run_id: str
    prompt_id: str
    prompt_ids: _OutArray
    samples: list[_OutSample]
    generator_id: str
    weight_version: int
    weight_hash: str
    sampling: dict
    task: str
    reference: str
    created_at: float
    scored_at: float
    sent_at: float


def encode_group(g: Group) -> bytes:
    """The group message (docs/protocol.md section 4): a msgpack map, written by msgspec's encoder
    (the same bytes as msgpack-python's ``packb`` of the map with ``use_bin_type=True``, several times
    faster)."""
    # the arrays' own memory when they already are the wire dtype and contiguous (as _wire_data, inline:
    # two calls a sample cost ~1 µs a group)
    samples = [
        _OutSample(
            completion_ids=_OutArray(
                "int32",
                d if (a := s.completion_ids).dtype is _I32 and (d := a.data).c_contiguous else _wire_data(a, _I32),
            ),
            logprobs=_OutArray(
                "float32", d if (a := s.logprobs).dtype is _F32 and (d := a.data).c_contiguous else _wire_data(a, _F32)
            ),
            version_runs=s.version_runs,
            trainable_runs=None if s.trainable is None else trainable_to_runs(s.trainable),
            finish_reason=s.finish_reason,
            reward=s.reward,
            reward_status=s.reward_status,
            reward_details=s.reward_details,
        )
        for s in g.samples
    ]
    return _ENCODER.encode(
        _OutGroup(
            SCHEMA_VERSION,
            "group",
            g.group_id,
            g.run_id,
            g.prompt_id,
            _OutArray("int32", _wire_data(g.prompt_ids, _I32)),
            samples,
            g.generator_id,
            g.weight_version,
            g.weight_hash,
            g.sampling,
            g.task,
            g.reference,
            g.created_at,
            g.scored_at,
            g.sent_at,
        )
    )


def decode_group(data: bytes | memoryview, max_bytes: int | None = None) -> Group:
    """Decode and validate a group message. Raises ProtocolError with a reason code.

    A well-formed group takes the schema's fast path (:func:`decode_group_fast`); anything it does not
    accept is decoded again and validated field by field, which names the problem."""
    _check_size(data, max_bytes)
    g = decode_group_fast(data)
    return g if g is not None else group_from_map(unpack_map(data))


def unpack_group(data: bytes | memoryview, max_bytes: int | None = None) -> dict:
    """The one msgpack decode of a group message: its size checked first (``too_large``), then decoded
    within msgpack's limits (codec.unpack_map). Validate the map with :func:`group_from_map`."""
    _check_size(data, max_bytes)
    return unpack_map(data)


def _check_size(data: bytes | memoryview, max_bytes: int | None) -> None:
    if max_bytes is not None and len(data) > max_bytes:
        raise ProtocolError("too_large", f"message of {len(data)} bytes exceeds limit {max_bytes}")


def group_from_map(m: dict) -> Group:
    """Validate a decoded group message (docs/protocol.md section 4).

    The value checks on the arrays (log-probs finite as float32 and <= 0, token ids >= 0) run once over
    all of a group's arrays together; a map failing any check is validated again checking in the
    documented order, so the reason is that of the first problem. Both passes run the same checks:
    they accept exactly the same messages. Neither decodes the message again."""
    try:
        return _validate_group(m, in_order=False)
    except ProtocolError:
        return _validate_group(m, in_order=True)  # raises the first problem's reason


def group_id_of(m: dict | None) -> str:
    """The group id of a decoded (possibly invalid) message, for its ack ("" when it has none)."""
    gid = m.get("group_id", "") if isinstance(m, dict) else ""
    return gid if isinstance(gid, str) else ""


def group_id_in_head(data: bytes | memoryview) -> str:
    """The group id of a message that is not decoded whole (``too_large``, or not msgpack at all), read from
    its first ``HEAD_BYTES`` only: the top-level map's first 16 keys, skipping their values, until
    ``group_id`` (Relay's encoder writes it third). "" when it is not there, not a 1..128 character string,
    or the bytes before it do not fit."""
    u = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=HEAD_BYTES)
    u.feed(bytes(data[:HEAD_BYTES]))
    try:
        for _ in range(min(u.read_map_header(), 16)):
            if u.unpack() == "group_id":
                gid = u.unpack()
                return gid if isinstance(gid, str) and 0 < len(gid) <= 128 else ""
            u.skip()
    except (msgpack.UnpackException, ValueError):  # not a map, cut off at HEAD_BYTES, invalid UTF-8, ...
        pass
    return ""


def finite32(x: float) -> bool:
    """Finite as float32, the dtype the learner computes in (1e300 is finite as float64, inf as float32)."""
    return math.isfinite(x) and abs(x) <= FLOAT32_MAX


def _validate_group(m: dict, in_order: bool) -> Group:
    schema = m.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema != SCHEMA_VERSION:
        raise ProtocolError("bad_schema", f"schema must be {SCHEMA_VERSION}, got {schema!r}")
    if m.get("kind") != "group":
        raise ProtocolError("bad_kind", f"kind must be 'group', got {m.get('kind')!r}")
    group_id = get_field(m, "group_id", str)
    if not group_id or len(group_id) > 128:
        raise ProtocolError("bad_group_id", "group_id must be 1..128 characters")
    raw_samples = get_field(m, "samples", list)
    if not raw_samples:
        raise ProtocolError("empty_group", "a group needs at least one sample")
    samples = []
    all_lps, all_ids = [], []  # checked together at the end unless in_order
    for i, s in enumerate(raw_samples):
        where = f"samples[{i}]"
        if not isinstance(s, dict):
            raise ProtocolError("bad_type", f"{where} must be a map")
        ids = decode_array(get_field(s, "completion_ids", dict, where), "int32", where + ".completion_ids")
        lps = decode_array(get_field(s, "logprobs", dict, where), "float32", where + ".logprobs")
        if len(ids) == 0:
            raise ProtocolError("empty_completion", f"{where} has no tokens")
        if len(lps) != len(ids):
            raise ProtocolError("length_mismatch", f"{where}: {len(lps)} logprobs for {len(ids)} tokens")
        if not in_order:
            all_lps.append(lps)
            all_ids.append(ids)
        elif not np.all(np.isfinite(lps)):
            raise ProtocolError("non_finite", f"{where}.logprobs: NaN or infinite log-prob")
        elif np.any(lps > 0):
            raise ProtocolError("bad_logprob", f"{where}: log-probs must be <= 0")
        elif np.any(ids < 0):
            raise ProtocolError("bad_token", f"{where}: negative token id")
        runs = get_field(s, "version_runs", list, where)
        if not all(
            isinstance(r, list)
            and len(r) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            and r[0] >= 0
            and r[1] > 0
            for r in runs
        ):
            raise ProtocolError("bad_versions", f"{where}.version_runs must be [[version>=0, count>0], ...]")
        if sum(r[1] for r in runs) != len(ids):
            raise ProtocolError(
                "length_mismatch", f"{where}: version runs cover {sum(r[1] for r in runs)} of {len(ids)} tokens"
            )
        trainable = _trainable(s, len(ids), where)
        finish = get_field(s, "finish_reason", str, where)
        if finish not in FINISH_REASONS:
            raise ProtocolError("bad_finish_reason", f"{where}.finish_reason {finish!r} not in {FINISH_REASONS}")
        status = get_field(s, "reward_status", str, where)
        if status not in REWARD_STATUSES:
            raise ProtocolError("bad_reward_status", f"{where}.reward_status {status!r} not in {REWARD_STATUSES}")
        reward = s.get("reward")
        if status == "ok":
            reward = get_field(s, "reward", float, where)
            if not finite32(reward):
                raise ProtocolError("non_finite", f"{where}.reward = {reward!r} is not finite as float32")
            if abs(reward) > REWARD_LIMIT:
                raise ProtocolError(
                    "reward_range",
                    f"{where}.reward = {reward!r} is outside "
                    f"[-{REWARD_LIMIT:g}, {REWARD_LIMIT:g}] (docs/protocol.md 3.2)",
                )
        elif reward is not None:
            raise ProtocolError("bad_reward", f"{where}.reward must be nil when status is failed")
        details = s.get("reward_details", {})
        if not isinstance(details, dict):
            raise ProtocolError("bad_type", f"{where}.reward_details must be a map")
        bad = next((k for k, v in details.items() if isinstance(v, float) and not finite32(v)), None)
        if bad is not None:
            raise ProtocolError("non_finite", f"{where}.reward_details.{bad} is not finite as float32")
        samples.append(Sample(ids, lps, runs, finish, reward, status, details, trainable))
    prompt_ids = decode_array(get_field(m, "prompt_ids", dict), "int32", "group.prompt_ids")
    if len(prompt_ids) == 0:
        raise ProtocolError("empty_prompt", "prompt_ids is empty")
    if not in_order:
        all_ids.append(prompt_ids)
    elif np.any(prompt_ids < 0):
        raise ProtocolError("bad_token", "group.prompt_ids: negative token id")
    weight_version = get_field(m, "weight_version", int)
    if weight_version < 0:
        raise ProtocolError("bad_versions", "weight_version must be >= 0")
    sampling = get_field(m, "sampling", dict)
    _check_sampling(sampling)
    created_at = get_field(m, "created_at", float)
    times = {k: optional_field(m, k, float, 0.0) for k in ("scored_at", "sent_at")}
    bad = next((k for k, t in {"created_at": created_at, **times}.items() if not finite32(t)), None)
    if bad is not None:
        raise ProtocolError("non_finite", f"group.{bad} is not finite")
    if not in_order:
        lps_all = np.concatenate(all_lps)
        if not (np.isfinite(lps_all).all() and (lps_all <= 0).all() and np.concatenate(all_ids).min() >= 0):
            raise ProtocolError("bad_logprob", "a log-prob or a token id is out of range")  # replaced: see above
    return Group(
        group_id=group_id,
        run_id=get_field(m, "run_id", str),
        prompt_id=get_field(m, "prompt_id", str),
        prompt_ids=prompt_ids,
        samples=samples,
        generator_id=get_field(m, "generator_id", str),
        weight_version=weight_version,
        weight_hash=get_field(m, "weight_hash", str),
        sampling=sampling,
        task=optional_field(m, "task", str, ""),
        reference=optional_field(m, "reference", str, ""),
        created_at=created_at,
        **times,
    )


# ----------------------------------------------------------------------------------------------
# the fast path: the group's schema checked by msgspec's C decoder
#
# The schema below is the group message of docs/protocol.md section 4 with no room to spare: no unknown
# field anywhere, flat maps (scalar values) for sampling and reward_details, msgpack's per-container
# limits. msgspec checks the types, the literals, the ranges and the lengths while it decodes; the
# checks that span fields (lengths against each other, run sums, rewards against their status, float32
# range) follow in Python, and the array values are checked together over one copy of all the arrays.
# Whatever this path does not accept goes to the field-by-field validation (group_from_map), which
# names the problem: the fast path may refuse a valid message (it is then merely slower), but it must
# never accept a message that group_from_map rejects, nor build a different Group
# (tests/unit/broker/test_protocol_fast.py checks both on random mutations).

_Scalar = Union[str, int, float, bool, None]
_FlatMap = Annotated[dict[str, _Scalar], msgspec.Meta(max_length=MAX_MAP_LEN)]
# The fast path takes groups of at most FAST_SAMPLES samples of at most FAST_RUNS version runs each, so what
# msgspec builds before the message's object budget is checked stays within a few MB whatever the message;
# larger groups, valid or not, go to the field-by-field validation. Version runs are decoded as the lists Sample
# holds, [version >= 0, count >= 0] (a count of 0 is refused after decoding).
FAST_SAMPLES, FAST_RUNS = 256, 64
_Runs = Annotated[
    list[Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=2, max_length=2)]],
    msgspec.Meta(max_length=FAST_RUNS),
]
# finite as float32 (finite32): msgspec refuses NaN, the infinities and anything beyond float32's range
_Float32 = Annotated[float, msgspec.Meta(ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
_Reward = Annotated[float, msgspec.Meta(ge=-REWARD_LIMIT, le=REWARD_LIMIT)]
_Flags = Annotated[
    list[tuple[Literal[0, 1], Annotated[int, msgspec.Meta(gt=0)]]], msgspec.Meta(max_length=MAX_ARRAY_LEN)
]
_NIL, _EMPTY_MAP = msgspec.Raw(b"\xc0"), msgspec.Raw(b"\x80")


class _Int32Array(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    dtype: Literal["int32"]
    data: memoryview  # a view of the message: the arrays are copied once, all together


class _Float32Array(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    dtype: Literal["float32"]
    data: memoryview


class _WireSample(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    completion_ids: _Int32Array
    logprobs: _Float32Array
    version_runs: _Runs
    # left raw until their sizes are known to fit the object budget (below), then decoded all together
    finish_reason: Literal["stop", "length"]
    reward_status: Literal["ok", "failed"]
    reward: Union[_Reward, None] = None
    reward_details: msgspec.Raw = _EMPTY_MAP
    trainable_runs: msgspec.Raw = _NIL


class _WireGroup(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    schema: Literal[1]
    kind: Literal["group"]
    group_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    run_id: str
    prompt_id: str
    prompt_ids: _Int32Array
    samples: Annotated[list[_WireSample], msgspec.Meta(min_length=1, max_length=FAST_SAMPLES)]
    generator_id: str
    weight_version: Annotated[int, msgspec.Meta(ge=0)]
    weight_hash: str
    sampling: _FlatMap
    created_at: _Float32
    task: Union[str, None] = None
    reference: Union[str, None] = None
    scored_at: Union[_Float32, None] = None
    sent_at: Union[_Float32, None] = None


_GROUP = msgspec.msgpack.Decoder(_WireGroup)
_ALL_FLAGS = msgspec.msgpack.Decoder(list[Union[_Flags, None]])
_ALL_MAPS = msgspec.msgpack.Decoder(list[_FlatMap])
_FAST_ERRORS = (msgspec.ValidationError, msgspec.DecodeError)


def _array_header(n: int) -> bytes:
    return (
        bytes([0x90 | n])
        if n < 16
        else (b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big"))
    )


def _decode_all(decoder: msgspec.msgpack.Decoder, raws: list[msgspec.Raw]):
    """Several raw msgpack values decoded by one call, as the elements of one array."""
    return decoder.decode(_array_header(len(raws)) + b"".join(raws))


@dataclass(slots=True)
class GroupHead:
    """What the broker needs of a group it has validated to append it (:func:`decode_group_fast` with
    ``head_only=True``): the same names as :class:`Group`'s, ``min_version``/``max_version`` over every
    token. The broker writes the message's own bytes; it never needs the samples built."""

    group_id: str
    run_id: str
    generator_id: str
    weight_version: int
    weight_hash: str
    min_version: int
    max_version: int


def decode_group_fast(data: bytes | memoryview, head_only: bool = False) -> Group | GroupHead | None:
    """The group in ``data`` when it is a well-formed group message (see above), else None. Never
    raises for bad input: None sends the message to the field-by-field validation. ``head_only``: every
    check the same, but a :class:`GroupHead` instead of the samples and the Group (the broker's ingest:
    ~3.5 µs, a quarter of the decode, less for a group of 8 samples).

    Written for speed (it runs on every group the broker takes in, and twice per group on the way to
    the learner): one pass over the samples for the checks that need nothing decoded beyond the schema,
    the raw values (multi-turn flags, sub-scores) decoded together, the array values checked over one
    copy of all the arrays (argmax and argmin: half a ufunc reduction's fixed cost, and they stop at a
    NaN just as well), then one pass building the samples. docs/benchmarks.md has what each step costs."""
    try:
        w = _GROUP.decode(data)
    except _FAST_ERRORS:
        return None
    if not _sampling_ok(w.sampling):
        return None
    ws, prompt = w.samples, w.prompt_ids.data
    ids_data, lps_data, tokens = [], [], []
    plain = True  # every sample single-turn and without reward details
    for s in ws:
        ids_b, lps_b = s.completion_ids.data, s.logprobs.data
        nbytes = len(ids_b)
        if (
            nbytes != len(lps_b) or not nbytes or nbytes & 3 or (s.reward is None) is not (s.reward_status == "failed")
        ):  # a reward with each "ok" only
            return None
        ids_data.append(ids_b)
        lps_data.append(lps_b)
        tokens.append(nbytes >> 2)
        # trainable_runs present (an absent field is msgspec's default object) or sub-scores
        if plain and (s.trainable_runs is not _NIL or s.reward_details != _EMPTY_MAP):
            plain = False
    if not len(prompt) or len(prompt) & 3:
        return None
    # Within the object budget (codec.object_budget) as group_from_map's decoder counts it (the raw values
    # are decoded only then): the fixed fields count at most 64 per group and 32 per sample; the rest of the
    # message (all but the arrays' data) holds at most one object per byte, each counted at most twice
    # (as an element, and as a container of its own).
    rest = len(data) - 8 * sum(tokens) - len(prompt)
    if 64 + 32 * len(ws) + 2 * rest > object_budget(len(data)):
        return None
    flags = details = None
    try:
        if not plain:
            flags = _decode_all(_ALL_FLAGS, [s.trainable_runs for s in ws])
            details = _decode_all(_ALL_MAPS, [s.reward_details for s in ws])
    except _FAST_ERRORS:
        return None
    ids_data.append(prompt)
    # joined into writable memory: numpy's argmax is twice as fast there; read-only once checked, as the
    # arrays of the field-by-field validation are
    ids = np.frombuffer(bytearray().join(ids_data), _I32)
    lps = np.frombuffer(bytearray().join(lps_data), _F32)
    # the largest log-prob is NaN or > 0 for a NaN, +inf or positive one; the smallest NaN or -inf for a
    # NaN or -inf one (argmax and argmin stop at the first NaN)
    if not (lps[lps.argmax()] <= 0 and lps[lps.argmin()] > -np.inf and ids[ids.argmin()] >= 0):
        return None
    ids.setflags(write=False)
    lps.setflags(write=False)
    trainable: list = [None] * len(ws)
    if flags is not None:
        for i, (f, n) in enumerate(zip(flags, tokens)):
            if f is not None:
                if sum([c for _, c in f]) != n or not any([v == 1 for v, _ in f]):
                    return None
                trainable[i] = runs_to_trainable(f)
    if details is None:
        details = [{} for _ in ws]
    elif not all([finite32(v) for d in details for v in d.values() if type(v) is float]):
        return None
    if head_only:
        return _head(w, tokens)
    samples, start = [], 0
    for s, n, det, flag in zip(ws, tokens, details, trainable):
        runs = s.version_runs
        covered = 0  # the version runs cover the sample's tokens, none empty (an inline loop: a third of a
        for _, c in runs:  # comprehension's cost for the usual one or two runs)
            if not c:
                return None
            covered += c
        if covered != n:
            return None
        end = start + n
        samples.append(
            Sample(ids[start:end], lps[start:end], runs, s.finish_reason, s.reward, s.reward_status, det, flag)
        )
        start = end
    return Group(
        w.group_id,
        w.run_id,
        w.prompt_id,
        ids[start:],
        samples,
        w.generator_id,
        w.weight_version,
        w.weight_hash,
        w.sampling,
        "" if w.task is None else w.task,
        "" if w.reference is None else w.reference,
        w.created_at,
        0.0 if w.scored_at is None else w.scored_at,
        0.0 if w.sent_at is None else w.sent_at,
    )


def _head(w: _WireGroup, tokens: list[int]) -> GroupHead | None:
    """decode_group_fast's last check (the version runs cover each sample's tokens, none empty) and the
    versions over every token, without building the samples."""
    lo, hi = None, 0
    for s, n in zip(w.samples, tokens):
        covered = 0
        for v, c in s.version_runs:
            if not c:
                return None
            covered += c
            if lo is None or v < lo:
                lo = v
            if v > hi:
                hi = v
        if covered != n:
            return None
    return GroupHead(w.group_id, w.run_id, w.generator_id, w.weight_version, w.weight_hash, 0 if lo is None else lo, hi)


def _trainable(s: dict, n: int, where: str) -> np.ndarray | None:
    """A sample's ``trainable_runs`` (docs/protocol.md 3.5): absent or nil for a single-turn sample (None);
    else run-length 0/1 flags covering its ``n`` tokens, at least one token trainable."""
    runs = s.get("trainable_runs")
    if runs is None:
        return None
    if not isinstance(runs, list) or not all(
        isinstance(r, list)
        and len(r) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
        and r[0] in (0, 1)
        and r[1] > 0
        for r in runs
    ):
        raise ProtocolError("bad_trainable", f"{where}.trainable_runs must be [[0 or 1, count>0], ...]")
    if sum(r[1] for r in runs) != n:
        raise ProtocolError("length_mismatch", f"{where}: trainable runs cover {sum(r[1] for r in runs)} of {n} tokens")
    if not any(r[0] == 1 for r in runs):
        raise ProtocolError("bad_trainable", f"{where}: no token is trainable (a sample needs a model token)")
    return runs_to_trainable(runs)


# sampling keys the learner's recomputation depends on, with their validity checks
_SAMPLING_CHECKS = {
    "temperature": (float, lambda v: 0 < v <= 100),
    "top_p": (float, lambda v: 0 < v <= 1),
    "top_k": (int, lambda v: v >= 0),
}


def _check_sampling(sampling: dict) -> None:
    for key, (typ, ok) in _SAMPLING_CHECKS.items():
        if key in sampling:
            v = get_field(sampling, key, typ, "group.sampling")
            if not ok(v) or not math.isfinite(v):
                raise ProtocolError("bad_sampling", f"group.sampling.{key} = {v!r} is out of range")


def _sampling_ok(sampling: dict) -> bool:
    """_check_sampling's checks as one expression, for the fast path's flat map of scalars: a float field
    takes an int (not a bool), top_k an int; NaN and the infinities fail the range comparisons."""
    t, p, k = sampling.get("temperature", 1.0), sampling.get("top_p", 1.0), sampling.get("top_k", 0)
    return type(t) in _NUMBER and 0 < t <= 100 and type(p) in _NUMBER and 0 < p <= 1 and type(k) is int and k >= 0


_NUMBER = (int, float)


def sampling_transform(sampling: dict) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) of a group: what the learner must apply to recompute μ.
    Floats are rounded to 6 decimals, so 0.7 sent as float32 or float64 is the same transform."""
    return (
        round(float(sampling.get("temperature", 1.0)), 6),
        int(sampling.get("top_k", 0)),
        round(float(sampling.get("top_p", 1.0)), 6),
    )
