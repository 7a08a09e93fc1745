"""The learner's publication pipeline with real Redis and a real weight store (learner/publish.py,
generators/weights.py): versions announced in order with the digest of their tensors; a learner process
SIGKILLed in the middle of writing a version leaves nothing half announced; a generator refuses a
version whose tensors are not the ones announced even when its files match their manifest."""

import subprocess
import sys
import time

import torch
from safetensors.torch import save

from broker.client.announcements import announce, latest_announcement
from broker.client.connection import connect_redis
from broker.client.telemetry import read_events
from broker.protocol import tensordigest
from broker.protocol import weightstore as ws
from broker.protocol.keys import Keys
from broker.protocol.messages import Announcement
from generators.weights import WeightApplier
from learner.publish import first_version, write_safetensors
from tests.support.services import ROOT, RecordingBackend, announce_key, announce_key_file, child_env


def test_a_publisher_killed_mid_write_leaves_no_half_version_announced(redis_url, tmp_path):
    store, key = tmp_path / "weights", announce_key(tmp_path)
    r, keys = connect_redis(redis_url), Keys("kill")
    caught = 0  # kills that landed while a version was being written (its temporary folder left behind)
    for attempt in range(6):  # each restart carries on past what the previous one left
        if caught == 2:
            break
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.publish_loop",
                redis_url,
                str(store),
                str(announce_key_file(tmp_path)),
                str(tmp_path / "model"),
            ],
            cwd=ROOT,
            env=child_env(),
        )
        ours = f".tmp-v*-{p.pid}"  # the staging folders of this process (weightstore.staging_dir)
        try:
            deadline = time.monotonic() + 120
            start = len(ws.list_versions(store))
            # wait for a few versions, then for a version being written (its temporary folder), and kill
            while time.monotonic() < deadline and len(ws.list_versions(store)) < start + 3:
                assert p.poll() is None, "the publisher exited"
                time.sleep(0.02)
            while time.monotonic() < deadline and not list(store.glob(f"{ours}/model-*")):
                time.sleep(0.001)
        finally:
            p.kill()
            p.wait(10)
        half = [int(d.name.split("-")[1][1:]) for d in store.glob(ours)]
        caught += bool(half)
        latest = latest_announcement(r, keys, key)
        announced = [int(e.data["version"]) for _, e in read_events(r, keys, "0-0", 10**6) if e.kind == "published"]
        assert announced == sorted(announced) and len(set(announced)) == len(announced)  # in order, once each
        assert latest.version == announced[-1]
        assert not set(half) & set(announced)  # the version being written when it died was never announced
        for v in announced:  # every announced version is whole: files, manifest hash, tensors' digest
            assert ws.check(ws.version_dir(store, v), root=store, tensor_digest=True).digest
        checked = ws.check(latest.path, latest.hash, store, expected_digest=latest.digest)
        assert checked.manifest["version"] == latest.version
        assert len([f for f in checked.manifest["files"] if f.endswith(".safetensors")]) >= 2  # sharded
        assert not set(half) & set(ws.list_versions(store))  # never sealed either: a temporary folder, ignored
        assert first_version(latest.version, store) > max(ws.list_versions(store))
    assert caught >= 1, "no kill landed in the middle of a write"


def _version(store, v, state, key, r, keys, digest=None):
    staging = ws.staging_dir(store, v)
    known = write_safetensors(staging, state, 1 << 20)
    (staging / "config.json").write_text("{}")
    path, h = ws.seal(store, v, staging, known)
    a = Announcement(v, h, str(path), digest=digest or tensordigest.state_digest(state))
    announce(r, keys, a, key)
    return a


def test_a_tensor_altered_under_a_recomputed_manifest_is_refused_and_flagged(redis_url, tmp_path):
    store, key = tmp_path / "weights", announce_key(tmp_path)
    r, keys = connect_redis(redis_url), Keys("digest")
    good = {"w": torch.randn(16, 8).to(torch.bfloat16), "b": torch.zeros(8)}
    a1 = _version(store, 1, good, key, r, keys)
    backend = RecordingBackend()
    weights = WeightApplier(r, keys, backend, "g", announce_key=key, store=str(store))
    weights.update(block=True)
    assert weights.version == 1 and weights.digest == a1.digest
    applied = [e for _, e in read_events(r, keys, "0-0", 100) if e.kind == "applied"]
    assert applied[-1].data["digest"] == a1.digest
    # version 2 as published, but its weight file swapped for altered tensors and the folder re-sealed:
    # every sha256 matches the manifest, the manifest matches the announced hash, the tensors do not
    published = {"w": good["w"] + 1, "b": good["b"]}
    altered = {"w": published["w"].clone(), "b": published["b"]}
    altered["w"][0, 0] += 1
    staging = ws.staging_dir(store, 2)
    (staging / "model.safetensors").write_bytes(save(altered))
    (staging / "config.json").write_text("{}")
    path, h = ws.seal(store, 2, staging)
    announce(r, keys, Announcement(2, h, str(path), digest=tensordigest.state_digest(published)), key)
    weights.update()
    assert weights.version == 1 and backend.loaded == [str(store / "v000001")]  # still serving version 1
    assert weights.refused == {h: "digest_mismatch"} and weights.refused_updates == 1
    refused = [e for _, e in read_events(r, keys, "0-0", 100) if e.kind == "refused"]
    assert refused[-1].data == {"generator": "g", "version": 2, "reason": "digest_mismatch"}
    weights.update()  # never retried
    assert weights.refused_updates == 1 and len(backend.loaded) == 1
