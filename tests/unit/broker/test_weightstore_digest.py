"""The tensor digest a generator computes from the safetensors files it verifies (one read per file,
the header parsed without torch: broker/protocol/weightstore.py) equals the digest the learner announces
(tensordigest.state_digest of the published tensors); a tensor altered with its manifest recomputed
passes the hash check and is refused by the digest."""

import json
import struct

import pytest
import torch
from safetensors.torch import save

from broker.protocol import tensordigest
from broker.protocol import weightstore as ws
from learner.publish import write_safetensors


def _state():
    g = torch.Generator().manual_seed(1)
    return {
        "a.weight": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "b": torch.randn(5, generator=g),
        "c.half": torch.randn(3, 3, generator=g).half(),
        "ids": torch.arange(6, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False]),
    }


def test_header_digest_equals_state_digest_in_any_chunking():
    state = _state()
    data = save(state)
    assert tensordigest.combine(ws.safetensors_entries(data)) == tensordigest.state_digest(state)
    for algo in tensordigest.ALGORITHMS:
        for chunk in (1, 7, 64, 4096):  # fed as the file is read, in chunks of any size
            h = ws.TensorHasher("f", algo)
            for i in range(0, len(data), chunk):
                h.update(data[i : i + chunk])
            assert tensordigest.combine(h.finish(), algo) == tensordigest.state_digest(state, algo), (algo, chunk)


@pytest.mark.parametrize("threads", [1, 4])  # the shards verified one after another, or side by side
def test_sharded_version_digest_equals_state_digest(tmp_path, threads):
    state = {f"w{i}": torch.randn(64, 64).to(torch.bfloat16) for i in range(6)}
    staging = ws.staging_dir(tmp_path, 1)
    known = write_safetensors(staging, state, shard_bytes=3 * 64 * 64 * 2, threads=threads)
    assert len(known) == 2
    path, h = ws.seal(tmp_path, 1, staging, known)
    assert ws.check(path, h, tensor_digest=True, threads=threads).digest == tensordigest.state_digest(state)


def test_shards_verified_side_by_side_name_the_first_bad_file_in_manifest_order(tmp_path):
    state = {f"w{i}": torch.randn(64, 64).to(torch.bfloat16) for i in range(8)}
    staging = ws.staging_dir(tmp_path, 3)
    known = write_safetensors(staging, state, shard_bytes=2 * 64 * 64 * 2, threads=4)
    assert len(known) == 4
    path, h = ws.seal(tmp_path, 3, staging, known)
    names = list(ws.read_manifest(path)["files"])
    bad = [n for n in names if n.endswith(".safetensors")][1:3]  # two shards altered, one byte each
    for n in bad:
        f = path / n
        f.chmod(0o644)
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    with pytest.raises(ws.WeightStoreError) as e:
        ws.check(path, h, expected_digest=tensordigest.state_digest(state), threads=4)
    assert e.value.reason == "corrupt_file" and bad[0] in str(e.value) and bad[1] not in str(e.value)


def test_a_tampered_tensor_with_a_recomputed_manifest_is_refused(tmp_path):
    state = _state()
    staging = ws.staging_dir(tmp_path, 2)
    write_safetensors(staging, state, shard_bytes=1 << 20)
    announced = tensordigest.state_digest(state)
    tampered = dict(state)
    tampered["b"] = state["b"].clone()
    tampered["b"][0] += 1.0
    (staging / "model.safetensors").write_bytes(save(tampered))  # altered, then sealed: a consistent manifest
    path, h = ws.seal(tmp_path, 2, staging)
    assert ws.verify(path, h)  # the files match their manifest and the manifest its hash
    with pytest.raises(ws.WeightStoreError) as e:
        ws.check(path, h, expected_digest=announced)
    assert e.value.reason == "digest_mismatch"


def test_a_malformed_header_is_a_clear_error():
    good = save({"x": torch.ones(4)})
    with pytest.raises(ws.WeightStoreError, match="bad_safetensors.*ends inside tensor"):
        ws.safetensors_entries(good[:-3])
    with pytest.raises(ws.WeightStoreError, match="bad_safetensors.*not JSON"):
        ws.safetensors_entries(struct.pack("<Q", 3) + b"{{{")
    with pytest.raises(ws.WeightStoreError, match="bad_safetensors.*header"):
        ws.safetensors_entries(struct.pack("<Q", 0))
    header = json.dumps({"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}).encode()
    with pytest.raises(ws.WeightStoreError, match="bad_safetensors.*'x'"):
        ws.safetensors_entries(struct.pack("<Q", len(header)) + header + b"\0" * 4)


@pytest.mark.parametrize("keep", [False, True])  # read, or mapped to be loaded from (the torch backend's path)
def test_a_file_altered_in_its_header_is_corrupt_whether_mapped_or_read(tmp_path, keep):
    """The sha256 is finished whatever the header looks like: an altered file is ``corrupt_file`` (not a
    parse error first), with or without the tensor digest, and a refused version leaves nothing mapped."""
    state = {f"w{i}": torch.randn(64, 64) for i in range(3)}
    staging = ws.staging_dir(tmp_path, 4)
    path, h = ws.seal(tmp_path, 4, staging, write_safetensors(staging, state, shard_bytes=1 << 30))
    f = path / "model.safetensors"
    f.chmod(0o644)
    with open(f, "r+b") as fh:
        fh.seek(40)  # inside the JSON header
        fh.write(b"\xff\xff\xff\xff")
    for digest in (None, tensordigest.state_digest(state)):
        with pytest.raises(ws.WeightStoreError) as e:
            ws.check(path, h, expected_digest=digest, keep=keep)
        assert e.value.reason == "corrupt_file", e.value
    good = ws.staging_dir(tmp_path, 5)
    p5, h5 = ws.seal(tmp_path, 5, good, write_safetensors(good, state, shard_bytes=1 << 30))
    v = ws.check(p5, h5, expected_digest=tensordigest.state_digest(state), keep=keep)
    assert set(v.files) == ({"model.safetensors"} if keep else set())
    v.close()
