"""Fuzzing the broker's ingest with hypothesis: random bytes, random msgpack values and mutations
of a valid group, over a real ZeroMQ socket into a real broker process and a real Redis. The
broker must survive, answer every message, and account for each one as accepted, duplicate or
rejected with a reason."""

import os

import msgpack
import pytest
import redis
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from broker.client.telemetry import read_stats
from broker.protocol.keys import Keys
from broker.protocol.group import encode_group
from broker.protocol.messages import decode_ack
from tests.support.services import announce_key, producer_keys, start_broker
from tests.support.data import announce_make_group_versions, make_group

N = int(os.environ.get("RELAY_FUZZ_EXAMPLES", "40000"))
BATCH = 100

VALID = msgpack.unpackb(encode_group(make_group(group_id="seed")), raw=False)
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
    ("samples", 0, "completion_ids"),
    ("samples", 0, "logprobs"),
    ("samples", 0, "version_runs"),
    ("samples", 0, "finish_reason"),
    ("samples", 0, "reward"),
    ("samples", 0, "reward_status"),
    ("samples", 0, "reward_details"),
    ("samples", 1, "reward"),
    ("prompt_ids", "data"),
    ("prompt_ids", "dtype"),
    ("samples", 0, "logprobs", "data"),
    ("sampling", "temperature"),
    ("sampling", "top_p"),
    ("sampling", "top_k"),
]

leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=40),
)
values = st.recursive(
    leaf,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=12,
)


def _mutate(path, value, delete, gid):
    m = msgpack.unpackb(msgpack.packb(VALID), raw=False)
    m["group_id"] = gid
    d = m
    for k in path[:-1]:
        d = d[k]
    if delete and isinstance(d, dict):
        d.pop(path[-1], None)
    else:
        d[path[-1]] = value
    return msgpack.packb(m, use_bin_type=True)


@st.composite
def messages(draw):
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        return msgpack.packb(draw(values), use_bin_type=True)
    gid = f"fuzz-{draw(st.integers(0, 10**12))}"
    if kind == 2:
        return _mutate(draw(st.sampled_from(PATHS)), draw(values), draw(st.booleans()), gid)
    raw = bytearray(_mutate(("task",), "copy", False, gid))  # byte-level corruption of a valid group
    for _ in range(draw(st.integers(1, 4))):
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return bytes(raw)


@pytest.mark.slow
def test_ingest_survives_and_accounts_for_every_message(procs, redis_url, tmp_path):
    address, _ = start_broker(procs, redis_url, tmp_path, max_queue_groups=10**9, dead_letter_max=100)
    broker = next(c for c in procs.children if c.name == "broker")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    producer_keys(tmp_path).apply(sock)
    sock.connect(address)
    announce_make_group_versions(redis.Redis.from_url(redis_url), Keys("r"), announce_key(tmp_path))
    outcomes = {"ok": 0, "duplicate": 0, "rejected": 0}

    @settings(
        max_examples=N // BATCH,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(messages(), min_size=BATCH, max_size=BATCH))
    def batch(payloads):
        for p in payloads:  # pipelined: the broker answers in order, one ack per message
            sock.send_multipart([b"", p])
        for _ in payloads:
            assert sock.poll(10_000), "the broker stopped answering"
            _, reply = sock.recv_multipart()
            ack = decode_ack(reply)
            assert ack.status in outcomes, ack
            if ack.status == "rejected":
                assert ack.reason, "a rejection must name its reason"
            outcomes[ack.status] += 1

    batch()
    sent = sum(outcomes.values())
    assert sent >= N and broker.alive()
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    stats = read_stats(r, keys, "broker")
    assert stats.get("accepted", 0) == outcomes["ok"] == r.xlen(keys.trajectories)
    assert stats.get("duplicate", 0) == outcomes["duplicate"]
    assert stats.get("rejected_total", 0) == outcomes["rejected"]
    by_reason = sum(v for k, v in stats.items() if k.startswith("rejected:"))
    assert by_reason == outcomes["rejected"]
    assert outcomes["rejected"] > 0.5 * sent  # the fuzzer mostly produces invalid messages
