import pytest

from broker.protocol import weightstore as ws
from tests.support.data import snapshot


def test_seal_makes_an_immutable_verified_version(tmp_path):
    path, digest = snapshot(tmp_path, 3)
    assert path == tmp_path / "v000003" and not list(tmp_path.glob(".tmp-*"))
    manifest = ws.verify(path, digest)
    assert set(manifest["files"]) == {"model.safetensors", "config.json"} and manifest["version"] == 3
    with pytest.raises(ws.WeightStoreError, match="version_exists"):
        snapshot(tmp_path, 3)


def test_corrupt_or_missing_files_are_detected(tmp_path):
    path, digest = snapshot(tmp_path, 1)
    (path / "model.safetensors").write_bytes(b"weightz")
    with pytest.raises(ws.WeightStoreError) as e:
        ws.verify(path, digest)
    assert e.value.reason == "corrupt_file"
    (path / "model.safetensors").unlink()
    with pytest.raises(ws.WeightStoreError) as e:
        ws.verify(path, digest)
    assert e.value.reason == "missing_file"


def test_announced_hash_must_match(tmp_path):
    path, _ = snapshot(tmp_path, 1)
    with pytest.raises(ws.WeightStoreError) as e:
        ws.verify(path, "0" * 64)
    assert e.value.reason == "hash_mismatch"


def test_prune_keeps_newest_and_served_versions(tmp_path):
    for v in range(6):
        snapshot(tmp_path, v, bytes([v]))
    assert ws.prune(tmp_path, keep_last=2, in_use={1}) == [0, 2, 3]
    assert ws.list_versions(tmp_path) == [1, 4, 5]
