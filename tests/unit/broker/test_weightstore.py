import json

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


# an attacker who can write into the store (or forge a manifest) cannot get an unlisted file loaded


def _rewrite_manifest(path, files):
    """A manifest as an attacker writes it (its hash is what they would announce)."""
    manifest = {"version": 1, "files": files}
    (path / ws.MANIFEST).write_text(json.dumps(manifest))
    return ws.manifest_hash(manifest)


def test_an_unlisted_extra_weight_file_is_refused(tmp_path):
    path, digest = snapshot(tmp_path, 1)
    (path / "model-00002-of-00002.safetensors").write_bytes(b"attacker weights")
    with pytest.raises(ws.WeightStoreError) as e:
        ws.verify(path, digest)
    assert e.value.reason == "unlisted_file" and "model-00002-of-00002.safetensors" in str(e.value)


def test_a_manifest_name_leaving_the_folder_is_refused(tmp_path):
    path, _ = snapshot(tmp_path, 1)
    outside = tmp_path / "evil.safetensors"
    outside.write_bytes(b"attacker weights")
    for name in ("../evil.safetensors", str(outside), "sub/../../evil.safetensors"):
        digest = _rewrite_manifest(path, {name: ws.sha256_file(outside)})
        with pytest.raises(ws.WeightStoreError) as e:
            ws.verify(path, digest)
        assert e.value.reason == "bad_name", name


def test_a_symlink_out_of_the_store_is_refused(tmp_path):
    store = tmp_path / "store"
    path, _ = snapshot(store, 1)
    outside = tmp_path / "evil.safetensors"
    outside.write_bytes(b"attacker weights")
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to(outside)
    digest = _rewrite_manifest(
        path, {"model.safetensors": ws.sha256_file(outside), "config.json": ws.sha256_file(path / "config.json")}
    )
    with pytest.raises(ws.WeightStoreError) as e:
        ws.verify(path, digest)
    assert e.value.reason == "symlink"
    # a version folder that is itself a link out of the store, or any folder outside it
    other, other_digest = snapshot(tmp_path / "elsewhere", 2)
    (store / "v000002").symlink_to(other)
    for p in (store / "v000002", other, store / "v000001" / ".." / ".." / "elsewhere" / "v000002"):
        with pytest.raises(ws.WeightStoreError) as e:
            ws.verify(p, other_digest, root=store)
        assert e.value.reason == "outside_store", p
    assert ws.verify(other, other_digest)  # the same folder is fine where nobody asks for a store


def test_an_empty_manifest_fails_verification(tmp_path):
    path, _ = snapshot(tmp_path, 1)
    for f in path.iterdir():
        f.unlink()
    digest = _rewrite_manifest(path, {})
    with pytest.raises(ws.WeightStoreError) as e:
        ws.verify(path, digest)
    assert e.value.reason == "empty_manifest"
