"""The wire protocol pinned by test vectors, and kept in step with docs/protocol.md.

- tests/vectors/group_v1.msgpack holds the exact bytes of a small ``group`` message and
  tests/vectors/group_v1.json its decoded values; decoding must give those values and re-encoding
  must give the same bytes (a change of encoding would break producers written in other languages).
- ``build_group`` / ``send_group`` are the minimal producer of docs/protocol.md, copied verbatim
  (the test checks the doc still holds exactly this code): plain msgpack + zmq, no Relay imports.
"""

import hashlib
import inspect
import json
import re
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from broker.protocol.codec import ProtocolError
from broker.protocol.group import Group, Sample, decode_group, encode_group
from broker.protocol.messages import Ack, decode_ack, encode_ack
from broker.protocol.weightstore import manifest_hash
from tests.support.services import ROOT

VECTORS = ROOT / "tests" / "vectors"
DOC = ROOT / "docs" / "protocol.md"

# The weight-store manifest of docs/protocol.md section 6; its hash is the vector's weight_hash.
EXAMPLE_MANIFEST = {
    "version": 3,
    "files": {
        "config.json": "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
        "model.safetensors": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    },
}
EXAMPLE_CANONICAL = (
    '{"files":{"config.json":"44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",'
    '"model.safetensors":"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},"version":3}'
)
EXAMPLE_HASH = "6046ddcfdb736b74a6f080c04680c08c2390c3e2fbb3c02875817760f443559a"


# ---- the minimal producer of docs/protocol.md section 10, verbatim ---------------------------
# fmt: off (the document's text, byte for byte: test_doc_holds_the_minimal_producer_verbatim)


def build_group(
    group_id,
    run_id,
    prompt_id,
    prompt_ids,
    samples,
    generator_id,
    weight_version,
    weight_hash,
    sampling,
    task="",
    reference="",
    created_at=None,
    scored_at=0.0,
    sent_at=None,
):
    """Encode one Relay `group` message (schema 1). `samples` is a list of dicts with
    completion_ids (list of int), logprobs (list of float, one per token, each <= 0),
    versions (list of int: the policy version that sampled each token), finish_reason
    ("stop" or "length"), reward (float, or None when scoring failed) and, optionally,
    reward_details (dict with string keys) and, for a multi-turn sample, trainable (list of
    1 for a token the model sampled, 0 for a context token between its turns)."""

    def array(values, code, dtype):  # little-endian raw bytes in a msgpack bin
        return {"dtype": dtype, "data": struct.pack("<%d%s" % (len(values), code), *values)}

    def runs(versions):  # [3, 3, 4] -> [[3, 2], [4, 1]]
        out = []
        for v in versions:
            if out and out[-1][0] == v:
                out[-1][1] += 1
            else:
                out.append([v, 1])
        return out

    now = time.time()
    return msgpack.packb(
        {
            "schema": 1,
            "kind": "group",
            "group_id": group_id,
            "run_id": run_id,
            "prompt_id": prompt_id,
            "prompt_ids": array(prompt_ids, "i", "int32"),
            "samples": [
                {
                    "completion_ids": array(s["completion_ids"], "i", "int32"),
                    "logprobs": array(s["logprobs"], "f", "float32"),
                    "version_runs": runs(s["versions"]),
                    **({"trainable_runs": runs(s["trainable"])} if "trainable" in s else {}),
                    "finish_reason": s["finish_reason"],
                    "reward": None if s["reward"] is None else float(s["reward"]),
                    "reward_status": "failed" if s["reward"] is None else "ok",
                    "reward_details": s.get("reward_details", {}),
                }
                for s in samples
            ],
            "generator_id": generator_id,
            "weight_version": weight_version,
            "weight_hash": weight_hash,
            "sampling": sampling,
            "task": task,
            "reference": reference,
            "created_at": float(now if created_at is None else created_at),
            "scored_at": float(scored_at),
            "sent_at": float(now if sent_at is None else sent_at),
        },
        use_bin_type=True,
    )


def send_group(address, group_id, payload, timeout_s=10.0, give_up_s=3600.0, curve=None):
    """Send one encoded group to the broker; return the final ack as a dict whose status is
    "ok", "duplicate" or "rejected". Lazy pirate: when no reply comes within timeout_s, drop
    the socket and resend the same bytes on a fresh one; on "busy", back off and resend.
    curve: (the broker's public key, this producer's public key, its secret key), z85 text,
    when the broker runs CURVE (section 5.4); None for an insecure broker."""
    ctx = zmq.Context.instance()
    deadline = time.monotonic() + give_up_s
    pause = 0.05
    sock = None
    try:
        while time.monotonic() < deadline:
            if sock is None:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if curve is not None:  # before connect: the handshake uses them
                    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (k.encode() for k in curve)
                sock.connect(address)
            sock.send_multipart([b"", payload])  # empty delimiter frame, then the message
            if not sock.poll(int(timeout_s * 1000)):
                sock.close(linger=0)  # no reply: fresh socket, same bytes
                sock = None
                continue
            frames = sock.recv_multipart()
            try:
                ack = msgpack.unpackb(frames[-1], raw=False)
            except Exception:
                continue
            if not isinstance(ack, dict) or ack.get("kind") != "ack":
                continue
            if ack.get("group_id") != group_id and not (ack.get("status") == "rejected" and ack.get("group_id") == ""):
                continue  # not our ack
            if ack.get("status") == "busy":  # queue full: back off, then resend
                time.sleep(pause)
                pause = min(pause * 1.5, 1.0)
                continue
            return ack  # ok / duplicate / rejected: final, never resend
    finally:
        if sock is not None:
            sock.close(linger=0)
    raise TimeoutError(f"broker {address} did not take group {group_id} in {give_up_s}s")


# fmt: on


# ---- helpers ----------------------------------------------------------------------------------


def hexdump(data: bytes) -> str:
    """``hexdump -C`` style, as printed in docs/protocol.md section 9."""
    lines = []
    for off in range(0, len(data), 16):
        chunk = data[off : off + 16]
        hx = " ".join(f"{b:02x}" for b in chunk[:8]) + "  " + " ".join(f"{b:02x}" for b in chunk[8:])
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{off:08x}  {hx:<48}  |{text}|")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def vector() -> bytes:
    return (VECTORS / "group_v1.msgpack").read_bytes()


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads((VECTORS / "group_v1.json").read_text())


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def vector_inputs(expected: dict) -> dict:
    """The vector's values as arguments of the minimal producer's build_group."""
    e = expected
    return dict(
        group_id=e["group_id"],
        run_id=e["run_id"],
        prompt_id=e["prompt_id"],
        prompt_ids=e["prompt_ids"],
        samples=[
            {
                "completion_ids": s["completion_ids"],
                "logprobs": s["logprobs"],
                "versions": [v for v, n in s["version_runs"] for _ in range(n)],
                "finish_reason": s["finish_reason"],
                "reward": s["reward"],
                "reward_details": s["reward_details"],
            }
            for s in e["samples"]
        ],
        generator_id=e["generator_id"],
        weight_version=e["weight_version"],
        weight_hash=e["weight_hash"],
        sampling=e["sampling"],
        task=e["task"],
        reference=e["reference"],
        created_at=e["created_at"],
        scored_at=e["scored_at"],
        sent_at=e["sent_at"],
    )


# ---- the vector -------------------------------------------------------------------------------


def test_vector_decodes_to_the_expected_values(vector, expected):
    g = decode_group(vector)
    assert expected["schema"] == 1 and expected["kind"] == "group"
    for name in (
        "group_id",
        "run_id",
        "prompt_id",
        "generator_id",
        "weight_version",
        "weight_hash",
        "sampling",
        "task",
        "reference",
        "created_at",
        "scored_at",
        "sent_at",
    ):
        assert getattr(g, name) == expected[name], name
        assert type(getattr(g, name)) is type(expected[name]), name
    assert g.prompt_ids.dtype == np.dtype("<i4") and g.prompt_ids.tolist() == expected["prompt_ids"]
    assert len(g.samples) == len(expected["samples"])
    for s, e in zip(g.samples, expected["samples"]):
        assert s.completion_ids.dtype == np.dtype("<i4") and s.completion_ids.tolist() == e["completion_ids"]
        # the vector's log-probs are exactly representable in float32: compare exactly
        assert s.logprobs.dtype == np.dtype("<f4") and s.logprobs.tolist() == e["logprobs"]
        assert s.version_runs == e["version_runs"]
        assert s.finish_reason == e["finish_reason"]
        assert s.reward == e["reward"] and s.reward_status == e["reward_status"]
        assert s.reward_details == e["reward_details"]
    assert g.min_version == 3 and g.num_tokens == 4


def test_vector_top_level_keys_in_canonical_order(vector, expected):
    raw = msgpack.unpackb(vector, raw=False)
    assert list(raw) == list(expected)  # the JSON lists fields in the order encode_group writes them
    assert list(raw["samples"][0]) == list(expected["samples"][0])


def test_reencoding_the_decoded_vector_gives_identical_bytes(vector):
    assert encode_group(decode_group(vector)) == vector


def test_weight_hash_of_the_vector_is_the_documented_manifest_hash(expected, doc):
    assert json.dumps(EXAMPLE_MANIFEST, sort_keys=True, separators=(",", ":")) == EXAMPLE_CANONICAL
    assert hashlib.sha256(EXAMPLE_CANONICAL.encode()).hexdigest() == EXAMPLE_HASH
    assert manifest_hash(EXAMPLE_MANIFEST) == EXAMPLE_HASH == expected["weight_hash"]
    assert EXAMPLE_CANONICAL in doc and EXAMPLE_HASH in doc


def test_doc_example_group_encodes_to_the_vector(vector, doc):
    start = doc.index("```python\nGroup(") + len("```python\n")
    source = doc[start : doc.index("```", start)]
    assert encode_group(eval(source, {"Group": Group, "Sample": Sample, "np": np})) == vector


def test_doc_hex_dumps_are_the_real_bytes(vector, doc):
    assert hexdump(vector) in doc
    ack = encode_ack(Ack("g-0001", "ok", stream_id="1700000000123-0"))
    assert hexdump(ack) in doc
    assert decode_ack(ack) == Ack("g-0001", "ok", "", "1700000000123-0")


# ---- the minimal producer ---------------------------------------------------------------------


def test_doc_holds_the_minimal_producer_verbatim(doc):
    assert inspect.getsource(build_group) in doc
    assert inspect.getsource(send_group) in doc


def test_minimal_producer_reproduces_the_vector_byte_for_byte(vector, expected):
    assert build_group(**vector_inputs(expected)) == vector


def test_minimal_producer_messages_are_accepted(expected):
    data = build_group(
        group_id="7f3c0a9e5b2d4c1f8e6a0b9c3d2e1f00",
        run_id="demo",
        prompt_id="1700000000000-0",
        prompt_ids=[1, 4, 14],
        samples=[
            {
                "completion_ids": [5, 8, 9, 2],
                "logprobs": [-0.1, -2.5, -0.0, -0.7],
                "versions": [6, 6, 7, 7],
                "finish_reason": "stop",
                "reward": 1,
            },
            {
                "completion_ids": [3],
                "logprobs": [-1e-7],
                "versions": [7],
                "finish_reason": "length",
                "reward": None,
                "reward_details": {"reason": "reward_service: timeout"},
            },
        ],
        generator_id="go-gen-1",
        weight_version=6,
        weight_hash=expected["weight_hash"],
        sampling={"n": 2, "temperature": 0.7, "top_p": 0.95, "top_k": 0, "max_tokens": 16},
        task="copy",
        reference="47",
        scored_at=time.time(),
    )
    g = decode_group(data)
    assert g.group_id == "7f3c0a9e5b2d4c1f8e6a0b9c3d2e1f00" and g.run_id == "demo"
    assert g.prompt_ids.tolist() == [1, 4, 14]
    assert g.samples[0].completion_ids.tolist() == [5, 8, 9, 2]
    assert g.samples[0].logprobs.tolist() == pytest.approx([-0.1, -2.5, 0.0, -0.7])
    assert g.samples[0].version_runs == [[6, 2], [7, 2]] and g.samples[0].versions.tolist() == [6, 6, 7, 7]
    assert g.samples[0].reward == 1.0 and g.samples[0].reward_status == "ok"
    assert g.samples[1].reward is None and g.samples[1].reward_status == "failed"
    assert g.samples[1].reward_details == {"reason": "reward_service: timeout"}
    assert g.min_version == 6 and g.weight_version == 6
    assert g.sampling["temperature"] == 0.7 and g.created_at == g.sent_at > 0


def test_minimal_producer_bad_values_are_rejected(expected):
    kw = vector_inputs(expected)
    kw["samples"][0]["logprobs"] = [-0.5, 0.25, -0.125]  # a positive log-prob
    with pytest.raises(ProtocolError) as e:
        decode_group(build_group(**kw))
    assert e.value.reason == "bad_logprob"


class FakeBroker:
    """A ROUTER socket that answers like the broker (real decode_group / encode_ack), following a
    script of actions: "drop" (no reply), "busy", "ok"; records every frame list it receives."""

    def __init__(self, script):
        self.script = list(script)
        self.received = []
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            frames = self.sock.recv_multipart()
            self.received.append(frames)
            action = self.script.pop(0) if self.script else "ok"
            if action == "drop":
                continue
            ident, _, payload = frames
            try:
                gid = decode_group(payload).group_id
                ack = Ack(gid, "busy") if action == "busy" else Ack(gid, "ok", stream_id=f"1-{len(self.received)}")
            except ProtocolError as e:
                ack = Ack("", "rejected", reason=e.reason)
            self.sock.send_multipart([ident, b"", encode_ack(ack)])

    def close(self):
        self.stop.set()
        self.thread.join(2)
        self.sock.close(linger=0)


def test_minimal_sender_resends_the_same_bytes_after_a_timeout_and_busy(vector):
    broker = FakeBroker(["drop", "busy", "ok"])
    try:
        t0 = time.monotonic()
        ack = send_group(broker.address, "g-0001", vector, timeout_s=0.3, give_up_s=10)
        assert time.monotonic() - t0 < 5
    finally:
        broker.close()
    assert ack["status"] == "ok" and ack["group_id"] == "g-0001" and ack["stream_id"] == "1-3"
    assert len(broker.received) == 3
    for frames in broker.received:  # ROUTER sees [identity, empty delimiter, message]
        assert len(frames) == 3 and frames[1] == b"" and frames[2] == vector
    assert broker.received[0][0] != broker.received[1][0]  # the resend after the timeout used a fresh socket


def test_minimal_sender_takes_a_rejection_as_final():
    broker = FakeBroker([])
    try:
        ack = send_group(broker.address, "", b"\x00not msgpack", timeout_s=2, give_up_s=10)
    finally:
        broker.close()
    assert ack["status"] == "rejected" and ack["reason"] == "not_msgpack" and len(broker.received) == 1


def test_doc_tokenizer_vector_is_the_tiny_models(doc):
    """Section 3.4's tokenizer vector, against the tokenizer every `relay up --model tiny` snapshot ships."""
    from learner.tiny_model import build_tokenizer

    m = re.search(
        r'the prompt text `"473="` encodes to\s+`(\[[\d, ]+\])`.*?the EOS id is `(\d+)`.*?'
        r"is the completion `(\[[\d, ]+\])`",
        doc,
        re.S,
    )
    assert m, "docs/protocol.md 3.4 lost its tokenizer vector"
    tok = build_tokenizer()
    assert tok("473=")["input_ids"] == json.loads(m.group(1))
    assert tok.eos_token_id == int(m.group(2))
    assert tok("473")["input_ids"][1:] + [tok.eos_token_id] == json.loads(m.group(3))


# ---- the multi-turn vector (docs/protocol.md 3.5) -----------------------------------------------


def multiturn_inputs(e: dict) -> dict:
    kw = vector_inputs(e)
    for s, raw in zip(kw["samples"], e["samples"]):
        s["trainable"] = [f for f, n in raw["trainable_runs"] for _ in range(n)]
    return kw


def test_multiturn_vector_decodes_reencodes_and_is_what_the_minimal_producer_writes():
    data = (VECTORS / "group_multiturn_v1.msgpack").read_bytes()
    e = json.loads((VECTORS / "group_multiturn_v1.json").read_text())
    g = decode_group(data)
    s = g.samples[0]
    assert s.trainable.tolist() == [1] * 6 + [0] * 4 + [1] * 3  # turn, tool reply (context), answer
    assert s.num_trainable == 9 and len(s.completion_ids) == 13
    assert s.completion_ids.tolist() == e["samples"][0]["completion_ids"]
    assert s.version_runs == [[5, 6], [6, 7]]  # the weights changed between the two turns
    assert encode_group(g) == data
    assert build_group(**multiturn_inputs(e)) == data
    assert list(msgpack.unpackb(data, raw=False)["samples"][0]) == list(e["samples"][0])


@pytest.mark.parametrize(
    "runs, reason",
    [
        ([[1, 6], [0, 4], [1, 2]], "length_mismatch"),  # covers 12 of 13 tokens
        ([[1, 6], [2, 4], [1, 3]], "bad_trainable"),  # a flag other than 0 or 1
        ([[1, 6], [0, 0], [1, 7]], "bad_trainable"),  # an empty run
        ([[0, 13]], "bad_trainable"),  # nothing the model sampled
        ([[True, 13]], "bad_trainable"),  # booleans are not integers on this wire
        ("all", "bad_trainable"),
    ],
)
def test_bad_trainable_runs_are_rejected(runs, reason):
    raw = msgpack.unpackb((VECTORS / "group_multiturn_v1.msgpack").read_bytes(), raw=False)
    raw["samples"][0]["trainable_runs"] = runs
    with pytest.raises(ProtocolError) as e:
        decode_group(msgpack.packb(raw, use_bin_type=True))
    assert e.value.reason == reason


def test_single_turn_messages_carry_no_trainable_runs(vector):
    g = decode_group(vector)
    assert all(s.trainable is None for s in g.samples)
    assert b"trainable_runs" not in vector and b"trainable_runs" not in encode_group(g)
