"""The group decoder's fast path (broker/protocol/group.py, decode_group_fast): msgspec checks the schema
while it decodes. It may refuse a valid message (the field-by-field validation then decides, only
slower), but it must never accept a message that validation rejects, nor build a different Group."""

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.protocol.codec import ProtocolError, unpack_map
from broker.protocol.group import (
    Group,
    GroupHead,
    Sample,
    decode_group,
    decode_group_fast,
    encode_group,
    group_from_map,
)
from tests.support.data import make_group


def rich_group() -> Group:
    """make_group plus what it leaves out: a multi-turn sample, a zero log-prob, sub-scores, top-k."""
    g = make_group()
    g.samples.append(
        Sample(
            np.array([9, 8, 7, 6], np.int32),
            np.array([0.0, -0.5, -3e38, -1.0], np.float32),
            [[4, 4]],
            "stop",
            0.25,
            "ok",
            {"format": 1.0, "note": "ok", "n": 3, "flag": True},
            trainable=np.array([1, 0, 0, 1], np.uint8),
        )
    )
    g.sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "max_tokens": 16, "n": 3}
    return g


def slow(data: bytes) -> Group | None:
    try:
        return group_from_map(unpack_map(data))
    except ProtocolError:
        return None


def head_of(g: Group) -> GroupHead:
    return GroupHead(
        g.group_id, g.run_id, g.generator_id, g.weight_version, g.weight_hash, g.min_version, g.max_version
    )


def assert_same(a: Group, b: Group) -> None:
    def plain(g: Group) -> dict:
        d = dict(vars(g))
        d["prompt_ids"] = (g.prompt_ids.dtype.str, g.prompt_ids.tolist())
        d["samples"] = [
            {k: (v.dtype.str, v.tolist()) if isinstance(v, np.ndarray) else v for k, v in vars(s).items()}
            for s in g.samples
        ]
        return d

    pa, pb = plain(a), plain(b)
    assert pa == pb
    # same types too: ints stay ints, floats floats (1 == 1.0 would hide a difference)
    assert [type(v) for v in pa.values()] == [type(v) for v in pb.values()]
    for sa, sb in zip(pa["samples"], pb["samples"]):
        assert [type(v) for v in sa.values()] == [type(v) for v in sb.values()]
        assert [[type(x) for x in r] for r in sa["version_runs"]] == [[type(x) for x in r] for r in sb["version_runs"]]


@pytest.mark.parametrize("group", [make_group(), rich_group()], ids=["make_group", "rich"])
def test_valid_groups_take_the_fast_path_and_decode_exactly_as_the_validation_does(group):
    data = encode_group(group)
    fast = decode_group_fast(data)
    assert fast is not None
    assert_same(fast, slow(data))
    assert decode_group_fast(data, head_only=True) == head_of(fast)  # the broker's head: the same checks
    assert fast.samples[2].trainable.tolist() == [1, 0, 0, 1] if len(fast.samples) > 2 else True


def test_a_producer_writing_ints_for_floats_and_nils_for_optionals_takes_the_fast_path():
    m = msgpack.unpackb(encode_group(rich_group()), raw=False)
    m.update(created_at=1700000000, scored_at=None, sent_at=None, task=None, reference=None)
    m["samples"][0]["reward"] = 1
    m["samples"][2]["trainable_runs"] = [[1, 1], [0, 2], [1, 1]]
    del m["samples"][0]["reward_details"]
    data = msgpack.packb(m, use_bin_type=True)
    fast = decode_group_fast(data)
    assert fast is not None and fast.created_at == 1700000000.0 and fast.samples[0].reward == 1.0
    assert_same(fast, slow(data))


def test_the_encoder_writes_the_bytes_msgpack_python_writes():
    g = rich_group()
    m = msgpack.unpackb(encode_group(g), raw=False)
    assert encode_group(g) == msgpack.packb(m, use_bin_type=True)
    # numpy scalars (a reward computed with numpy) are written as the numbers they hold
    g.samples[0].reward = np.float64(0.5)
    assert decode_group(encode_group(g)).samples[0].reward == 0.5


def test_the_fast_path_keeps_the_object_budget():
    # 16 samples x 4,096 one-token runs: 720 kB of which 200 kB are runs, over the 65,536-object budget
    tokens = 4096
    samples = [
        Sample(
            np.zeros(tokens, np.int32),
            np.full(tokens, -1.0, np.float32),
            [[v, 1] for v in range(tokens)],
            "length",
            0.0,
        )
        for _ in range(16)
    ]
    data = encode_group(make_group(samples=samples))
    assert decode_group_fast(data) is None
    with pytest.raises(ProtocolError) as e:
        decode_group(data)
    assert e.value.reason == "too_complex"


def test_groups_beyond_the_fast_paths_limits_are_checked_field_by_field_and_accepted():
    # 65 version runs in a sample (a long completion across many weight updates), and 257 samples
    runs = make_group(
        samples=[
            Sample(
                np.arange(65, dtype=np.int32), np.full(65, -1.0, np.float32), [[v, 1] for v in range(65)], "length", 0.0
            )
        ]
    )
    many = make_group(
        samples=[
            Sample(np.arange(3, dtype=np.int32), np.full(3, -1.0, np.float32), [[0, 3]], "stop", 1.0)
            for _ in range(257)
        ]
    )
    for g in (runs, many):
        data = encode_group(g)
        assert decode_group_fast(data) is None
        assert_same(decode_group(data), g)


def test_the_fast_path_returns_read_only_arrays_as_the_validation_does():
    data = encode_group(rich_group())
    fast, expected = decode_group_fast(data), slow(data)

    def arrays(g):
        return [g.prompt_ids] + [a for s in g.samples for a in (s.completion_ids, s.logprobs)]

    assert [a.flags.writeable for a in arrays(fast)] == [a.flags.writeable for a in arrays(expected)]
    assert not any(a.flags.writeable for a in arrays(fast))


VALID = msgpack.unpackb(encode_group(rich_group()), raw=False)
PATHS = [
    ("schema",),
    ("kind",),
    ("group_id",),
    ("run_id",),
    ("prompt_id",),
    ("prompt_ids",),
    ("samples",),
    ("generator_id",),
    ("weight_version",),
    ("weight_hash",),
    ("sampling",),
    ("task",),
    ("reference",),
    ("created_at",),
    ("scored_at",),
    ("sent_at",),
    ("extra",),
    ("samples", 0, "completion_ids"),
    ("samples", 0, "logprobs"),
    ("samples", 0, "version_runs"),
    ("samples", 0, "finish_reason"),
    ("samples", 0, "reward"),
    ("samples", 0, "reward_status"),
    ("samples", 0, "reward_details"),
    ("samples", 0, "extra"),
    ("samples", 1, "reward"),
    ("samples", 2, "trainable_runs"),
    ("samples", 2, "reward_details", "format"),
    ("samples", 0, "version_runs", 0),
    ("samples", 0, "version_runs", 0, 1),
    ("samples", 2, "trainable_runs", 0, 0),
    ("prompt_ids", "data"),
    ("prompt_ids", "dtype"),
    ("prompt_ids", "extra"),
    ("samples", 0, "logprobs", "data"),
    ("samples", 0, "completion_ids", "data"),
    ("sampling", "temperature"),
    ("sampling", "top_p"),
    ("sampling", "top_k"),
    ("sampling", "extra"),
]

leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.floats(width=32),
    st.sampled_from([0, 1, -1, 0.0, 1.0, -0.0, 1e39, "stop", "ok", "failed"]),
    st.text(max_size=20),
    st.binary(max_size=40),
    st.lists(st.floats(-5, 1, width=32), max_size=6).map(lambda xs: np.array(xs, "<f4").tobytes()),
)
values = st.recursive(
    leaf,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=10,
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(PATHS), values, st.booleans()), min_size=1, max_size=3))
def test_the_fast_path_never_accepts_what_the_validation_rejects(changes):
    m = msgpack.unpackb(msgpack.packb(VALID), raw=False)
    for path, value, delete in changes:
        d = m
        try:
            for k in path[:-1]:
                d = d[k]
            if delete and isinstance(d, dict):
                d.pop(path[-1], None)
            else:
                d[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    try:
        data = msgpack.packb(m, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return
    fast, expected = decode_group_fast(data), slow(data)
    head = decode_group_fast(data, head_only=True)
    assert (head is None) == (fast is None), "the broker's head-only decode and the full one disagree"
    if fast is not None:
        assert expected is not None, "the fast path accepted a message the validation rejects"
        assert_same(fast, expected)
        assert head == head_of(expected)


def test_non_finite_and_positive_log_probs_never_pass_the_fast_path():
    for bad in (math.nan, math.inf, -math.inf, 1e-30, 1.0):
        m = msgpack.unpackb(encode_group(make_group()), raw=False)
        m["samples"][1]["logprobs"]["data"] = np.array([bad], "<f4").tobytes()
        data = msgpack.packb(m, use_bin_type=True)
        assert decode_group_fast(data) is None and decode_group_fast(data, head_only=True) is None
        assert slow(data) is None
