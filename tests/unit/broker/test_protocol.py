import math

import msgpack
import numpy as np
import pytest

from broker.protocol.codec import ProtocolError
from broker.protocol.group import decode_group, encode_group, runs_to_versions, versions_to_runs
from broker.protocol.messages import Ack, Announcement, decode_ack, decode_announcement, encode_ack, encode_announcement
from tests.support.data import make_group


def mutate(**changes) -> bytes:
    m = msgpack.unpackb(encode_group(make_group()), raw=False)
    for path, value in changes.items():
        d = m
        keys = path.split(".")
        for k in keys[:-1]:
            d = d[int(k)] if k.isdigit() else d[k]
        d[keys[-1]] = value
    return msgpack.packb(m, use_bin_type=True)


def test_round_trip_keeps_every_field():
    g = make_group()
    out = decode_group(encode_group(g))
    assert out.group_id == "g1" and out.run_id == "r" and out.prompt_ids.tolist() == [1, 4, 14]
    assert out.samples[0].completion_ids.tolist() == [5, 6, 2]
    assert out.samples[0].logprobs.tolist() == pytest.approx([-0.5, -1.0, -0.1])
    assert out.samples[0].versions.tolist() == [3, 3, 4]
    assert out.samples[1].reward is None and out.samples[1].reward_status == "failed"
    assert out.samples[1].reward_details == {"reason": "timeout"}
    assert out.min_version == 3 and out.num_tokens == 4
    assert out.sampling == {"temperature": 1.0, "n": 2}


def test_arrays_are_little_endian_raw_bytes():
    m = msgpack.unpackb(encode_group(make_group()), raw=False)
    arr = m["samples"][0]["completion_ids"]
    assert arr == {"dtype": "int32", "data": b"\x05\x00\x00\x00\x06\x00\x00\x00\x02\x00\x00\x00"}


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"schema": 2}, "bad_schema"),
        ({"kind": "ack"}, "bad_kind"),
        ({"samples": []}, "empty_group"),
        ({"samples.0.logprobs": {"dtype": "float32", "data": np.array([-1, 0.5, -1], "<f4").tobytes()}}, "bad_logprob"),
        (
            {"samples.0.logprobs": {"dtype": "float32", "data": np.array([-1, math.nan, -1], "<f4").tobytes()}},
            "non_finite",
        ),
        (
            {"samples.0.logprobs": {"dtype": "float32", "data": np.array([-1, -math.inf, -1], "<f4").tobytes()}},
            "non_finite",
        ),
        ({"samples.0.logprobs": {"dtype": "float32", "data": np.array([-1, -1], "<f4").tobytes()}}, "length_mismatch"),
        ({"samples.0.completion_ids": {"dtype": "int64", "data": b"\0" * 24}}, "bad_dtype"),
        ({"samples.0.completion_ids": {"dtype": "int32", "data": b"\0" * 7}}, "bad_array"),
        ({"samples.0.version_runs": [[3, 2]]}, "length_mismatch"),
        ({"samples.0.version_runs": [[-1, 3]]}, "bad_versions"),
        ({"samples.0.finish_reason": "eos"}, "bad_finish_reason"),
        ({"samples.0.reward": math.inf}, "non_finite"),
        ({"samples.0.reward": 1e300}, "non_finite"),  # finite as float64, inf as float32
        ({"samples.0.reward_details": {"score": 1e39}}, "non_finite"),
        ({"samples.1.reward": 0.0}, "bad_reward"),
        ({"group_id": ""}, "bad_group_id"),
        ({"weight_version": "3"}, "bad_type"),
        ({"weight_version": -1}, "bad_versions"),
        ({"schema": True}, "bad_schema"),
        ({"prompt_ids": {"dtype": "int32", "data": np.array([1, -4], "<i4").tobytes()}}, "bad_token"),
        ({"sampling": {"temperature": 0.0}}, "bad_sampling"),
        ({"sampling": {"top_p": 1.5}}, "bad_sampling"),
        ({"sampling": {"top_k": 1.5}}, "bad_type"),
        ({"created_at": math.nan}, "non_finite"),
        ({"scored_at": "soon"}, "bad_type"),
        ({"task": 3}, "bad_type"),
    ],
)
def test_invalid_messages_are_rejected_with_a_reason(changes, reason):
    with pytest.raises(ProtocolError) as e:
        decode_group(mutate(**changes))
    assert e.value.reason == reason


def test_missing_field_and_garbage():
    m = msgpack.unpackb(encode_group(make_group()), raw=False)
    del m["run_id"]
    with pytest.raises(ProtocolError, match="missing_field"):
        decode_group(msgpack.packb(m))
    for junk in (b"", b"\xc1", b"\x92\x01\x02", b"hello"):
        with pytest.raises(ProtocolError):
            decode_group(junk)


def test_the_non_finite_reason_names_the_field():
    with pytest.raises(ProtocolError) as e:
        decode_group(mutate(**{"samples.0.reward": 1e300}))
    assert e.value.reason == "non_finite" and "samples[0].reward" in e.value.detail
    nan = np.array([-0.5, math.nan, -0.1], np.float32).tobytes()
    with pytest.raises(ProtocolError) as e:
        decode_group(mutate(**{"samples.0.logprobs.data": nan}))
    assert e.value.reason == "non_finite" and "samples[0].logprobs" in e.value.detail


def test_nested_container_headers_cannot_make_the_decoder_allocate_more_than_the_limits():
    # 1000 nested arrays, each claiming 2**31 elements: a few KiB that must not become gigabytes
    bomb = b"\xdd\x7f\xff\xff\xff" * 1000
    with pytest.raises(ProtocolError) as e:
        decode_group(bomb, max_bytes=16 << 20)
    assert e.value.reason == "not_msgpack"


def test_a_message_of_many_small_objects_is_refused_before_they_are_made():
    # 16 MiB of empty maps would be ~1 GiB of Python dicts: refused by the object budget
    many = msgpack.packb({"schema": 1, "kind": "group", "x": [[{}] * 4096] * 4000})
    with pytest.raises(ProtocolError) as e:
        decode_group(many, max_bytes=16 << 20)
    assert e.value.reason == "too_complex"


def test_size_limit():
    with pytest.raises(ProtocolError) as e:
        decode_group(encode_group(make_group()), max_bytes=100)
    assert e.value.reason == "too_large"


def test_optional_fields_may_be_nil_and_transform_is_normalised():
    from broker.protocol.group import sampling_transform

    g = decode_group(mutate(scored_at=None, task=None, sampling={"temperature": 0.699999988079071}))
    assert g.scored_at == 0.0 and g.task == ""
    assert sampling_transform(g.sampling) == sampling_transform({"temperature": 0.7}) == (0.7, 0, 1.0)


def test_version_runs():
    assert versions_to_runs([3, 3, 4, 4, 4, 3]) == [[3, 2], [4, 3], [3, 1]]
    assert runs_to_versions([[3, 2], [4, 1]]).tolist() == [3, 3, 4]


def test_ack_and_announcement_round_trip():
    assert decode_ack(encode_ack(Ack("g", "busy"))) == Ack("g", "busy")
    a = Announcement(7, "h" * 64, "/store/v000007", published_at=12.5)
    assert decode_announcement(encode_announcement(a)) == a


def test_the_reason_is_the_first_problem_in_order_though_array_values_are_checked_together():
    # sample 0's log-prob is +1 and sample 1's finish_reason is bad: the documented order says bad_logprob
    data = mutate(
        **{
            "samples.0.logprobs.data": np.array([-0.5, 1.0, -0.1], np.float32).tobytes(),
            "samples.1.finish_reason": "eos",
        }
    )
    with pytest.raises(ProtocolError) as e:
        decode_group(data)
    assert e.value.reason == "bad_logprob" and "samples[0]" in e.value.detail
    # a negative prompt id comes after every sample's checks, a negative completion id before them
    data = mutate(**{"prompt_ids.data": np.array([1, -4, 14], np.int32).tobytes(), "samples.1.reward_status": "x"})
    with pytest.raises(ProtocolError) as e:
        decode_group(data)
    assert e.value.reason == "bad_reward_status"
    data = mutate(**{"prompt_ids.data": np.array([1, -4, 14], np.int32).tobytes()})
    with pytest.raises(ProtocolError) as e:
        decode_group(data)
    assert e.value.reason == "bad_token" and "prompt_ids" in e.value.detail
    data = mutate(**{"samples.1.completion_ids.data": np.array([-7], np.int32).tobytes()})
    with pytest.raises(ProtocolError) as e:
        decode_group(data)
    assert e.value.reason == "bad_token" and "samples[1]" in e.value.detail


@pytest.mark.parametrize("reward", [3e38, -3e38, 1e6 + 1, -2e6])
def test_a_reward_beyond_the_documented_bound_is_rejected_reward_range(reward):
    from broker.protocol.group import REWARD_LIMIT, decode_group_fast

    assert REWARD_LIMIT == 1e6  # docs/protocol.md 3.2
    data = mutate(**{"samples.0.reward": reward})
    assert decode_group_fast(data) is None  # the fast path does not take it either
    with pytest.raises(ProtocolError) as e:
        decode_group(data)
    assert e.value.reason == "reward_range" and "samples[0].reward" in e.value.detail and "1e+06" in e.value.detail


@pytest.mark.parametrize("reward", [1e6, -1e6, 0.5, -3])
def test_a_reward_within_the_bound_is_accepted(reward):
    assert decode_group(mutate(**{"samples.0.reward": reward})).samples[0].reward == reward


def test_the_group_id_of_a_message_not_decoded_whole_is_read_from_its_head():
    from broker.protocol.group import group_id_in_head

    assert group_id_in_head(encode_group(make_group(group_id="abc", reference="x" * 100_000))) == "abc"
    late = msgpack.packb({"pad": b"\0" * 5000, "group_id": "late"})  # past the first 4096 bytes: unknown
    assert group_id_in_head(late) == "" and group_id_in_head(b"\xc1 garbage") == "" and group_id_in_head(b"") == ""
    assert group_id_in_head(msgpack.packb({"group_id": 7})) == "" and group_id_in_head(msgpack.packb([1])) == ""
