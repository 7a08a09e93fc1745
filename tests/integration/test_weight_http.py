"""The http weight transport over real HTTP on free ports: the learner's weight server
(learner/weight_server.py) serves only sealed versions' listed files, with ranges; the generator's
fetcher (generators/weight_fetch.py) resumes a dropped download, refuses a corrupted byte, and a
version pruned before it was fetched is superseded, not refused (real Redis for the applier)."""

from __future__ import annotations

import http.client
import json
import os
import shutil

import pytest

from broker.client.announcements import announce
from broker.client.connection import connect_redis
from broker.client.telemetry import read_events
from broker.protocol import weightstore
from broker.protocol.keys import Keys
from broker.protocol.messages import Announcement
from broker.protocol.weights_config import HttpTransport
from generators.weight_fetch import WeightFetcher
from generators.weights import WeightApplier
from learner.weight_server import WeightServer, parse_range, RangeError
from tests.support.flaky_proxy import FlakyProxy
from tests.support.services import RecordingBackend

SIZE = 3 * (1 << 20) + 12345  # several chunks of the fetcher, not a multiple of one


def _publish(store, version: int, size: int = SIZE) -> Announcement:
    d = weightstore.staging_dir(store, version)
    (d / "model.safetensors").write_bytes(os.urandom(size))
    (d / "config.json").write_text(json.dumps({"version": version}))
    path, digest = weightstore.seal(store, version, d)
    return Announcement(version, digest, str(path))


@pytest.fixture
def served(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    server = WeightServer(store).start()
    yield store, server
    server.close()


def _get(server: WeightServer, path: str, method: str = "GET", **headers):
    host, port = server.http.server_address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request(method, path, headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp, body


def test_serves_listed_files_whole_by_range_and_head(served):
    store, server = served
    a = _publish(store, 3)
    data = (weightstore.version_dir(store, 3) / "model.safetensors").read_bytes()
    digest = weightstore.read_manifest(weightstore.version_dir(store, 3))["files"]["model.safetensors"]

    resp, body = _get(server, "/v000003/model.safetensors")
    assert resp.status == 200 and body == data and resp.getheader("ETag") == f'"{digest}"'
    resp, body = _get(server, "/v000003/manifest.json")
    assert weightstore.manifest_hash(json.loads(body)) == a.hash
    resp, body = _get(server, "/v000003/model.safetensors", "HEAD")
    assert resp.status == 200 and body == b"" and int(resp.getheader("Content-Length")) == SIZE
    assert resp.getheader("Accept-Ranges") == "bytes"

    resp, body = _get(server, "/v000003/model.safetensors", Range="bytes=1000-1999")
    assert resp.status == 206 and body == data[1000:2000]
    assert resp.getheader("Content-Range") == f"bytes 1000-1999/{SIZE}"
    resp, body = _get(server, "/v000003/model.safetensors", Range="bytes=-10")
    assert resp.status == 206 and body == data[-10:]
    resp, body = _get(server, "/v000003/model.safetensors", Range=f"bytes={SIZE - 5}-")
    assert resp.status == 206 and body == data[-5:]
    for bad in (f"bytes={SIZE}-", "bytes=0-1,5-9", "bytes=9-2", "lines=0-9", "bytes=-0"):
        resp, _ = _get(server, "/v000003/model.safetensors", Range=bad)
        assert resp.status == 416 and resp.getheader("Content-Range") == f"bytes */{SIZE}", bad
    assert server.url(3) == f"{server.base_url}/v000003/"


def test_nothing_but_sealed_versions_listed_files(served, tmp_path):
    store, server = served
    _publish(store, 1)
    (tmp_path / "secret.txt").write_text("not weights")
    vdir = weightstore.version_dir(store, 1)
    (vdir / "unlisted.bin").write_bytes(b"x")  # in the folder, not in its manifest
    staging = weightstore.staging_dir(store, 2)  # a version still being written
    (staging / "config.json").write_text("{}")
    os.symlink(vdir, store / "v000007")  # a linked version folder
    a3 = _publish(store, 3)
    v3 = weightstore.version_dir(store, 3)
    (v3 / "config.json").unlink()
    os.symlink(tmp_path / "secret.txt", v3 / "config.json")  # a listed name that is now a link out
    for path in (
        "/v000001/unlisted.bin",
        "/v000001/../../secret.txt",
        "/v000001/%2e%2e/%2e%2e/secret.txt",
        "/../secret.txt",
        "/secret.txt",
        "/",
        "/v000001",
        "/v000001/",
        f"/{staging.name}/config.json",
        "/v000007/config.json",
        "/v000003/config.json",
        "/v000004/config.json",
        "/v1/config.json",
        "/v000001//config.json",
        "/v000001/.hidden",
    ):
        resp, body = _get(server, path)
        assert resp.status == 404 and b"not weights" not in body, path
        resp, _ = _get(server, path, "HEAD")
        assert resp.status == 404, path
    assert _get(server, "/v000001/config.json")[0].status == 200
    assert _get(server, "/v000003/model.safetensors")[0].status == 200 and a3.version == 3


def test_bearer_token_required_with_the_runs_weights_key(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    a = _publish(store, 1, 1000)
    server = WeightServer(store, token="t0ken").start()
    try:
        assert _get(server, "/v000001/manifest.json")[0].status == 401
        assert _get(server, "/v000001/manifest.json", Authorization="Bearer wrong")[0].status == 401
        assert _get(server, "/v000001/manifest.json", Authorization="Bearer t0ken")[0].status == 200
        a.url = server.url(1)
        with pytest.raises(weightstore.WeightStoreError) as e:
            WeightFetcher(
                HttpTransport(cache_dir=str(tmp_path / "c1"), advertise_url=server.base_url), token="nope"
            ).fetch(a)
        assert e.value.reason == "unauthorized"
        path = WeightFetcher(
            HttpTransport(cache_dir=str(tmp_path / "c2"), advertise_url=server.base_url), token="t0ken"
        ).fetch(a)
        assert weightstore.verify(path, a.hash, tmp_path / "c2")["version"] == 1
    finally:
        server.close()


def test_a_generator_fetches_only_from_its_configured_server_whatever_url_an_announcement_names(tmp_path):
    """A thief's own weight server, named by an announcement (signed with a stolen key, or written into Redis
    under announce_auth = insecure), with the token the generator sends: the generator never asks it for
    anything, and fetches the version from the learner's server its config names."""
    from pathlib import Path

    real_store, evil_store = tmp_path / "real", tmp_path / "evil"
    real_store.mkdir()
    evil_store.mkdir()
    a = _publish(real_store, 1, 1000)
    shutil.copytree(Path(a.path), evil_store / "v000001")  # the same version, served by the thief
    real, evil = WeightServer(real_store, token="t0ken").start(), WeightServer(evil_store).start()
    try:
        a.url = evil.url(1)
        fetcher = WeightFetcher(
            HttpTransport(cache_dir=str(tmp_path / "cache"), advertise_url=real.base_url), token="t0ken"
        )
        path = fetcher.fetch(a)
        assert weightstore.verify(path, a.hash)["version"] == 1
        assert not evil.counts and real.counts["200"] >= 3  # manifest, model, config: from the learner's only
        with pytest.raises(Exception, match="advertise_url"):  # no configured server: no fetching at all
            WeightFetcher(HttpTransport(cache_dir=str(tmp_path / "c2")))
    finally:
        real.close()
        evil.close()


def test_parse_range_edges():
    assert parse_range("bytes=0-0", 10) == (0, 1)
    assert parse_range("bytes=5-100", 10) == (5, 10)
    assert parse_range("bytes=-100", 10) == (0, 10)
    for bad in ("bytes=10-", "bytes=-", "bytes=a-b", "bytes=3-1", "bytes=0-1,2-3"):
        with pytest.raises(RangeError):
            parse_range(bad, 10)


def test_a_dropped_download_resumes_with_a_range_request(served, tmp_path):
    store, server = served
    a = _publish(store, 5)
    proxy = FlakyProxy(server.http.server_address, b"model.safetensors", cut_after=1_500_000, drops=2)
    try:
        a.url = f"http://127.0.0.1:{proxy.port}/v000005/"
        fetcher = WeightFetcher(HttpTransport(cache_dir=str(tmp_path / "cache"), port=proxy.port))
        path = fetcher.fetch(a)
    finally:
        proxy.close()
    assert proxy.cut == 2 and fetcher.resumed == 2
    ranges = [h for h in proxy.requests if b"model.safetensors" in h and b"Range: bytes=" in h]
    assert len(ranges) == 2  # the two resumes asked only for what was missing
    served_bytes = (weightstore.version_dir(store, 5) / "model.safetensors").read_bytes()
    assert (path / "model.safetensors").read_bytes() == served_bytes
    assert weightstore.verify(path, a.hash, tmp_path / "cache")["version"] == 5
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["v000005"]  # no staging folder left


class StubBackend(RecordingBackend):
    """Loads nothing; records which folders it was given (each must hold the config)."""

    def load(self, path):
        assert os.path.isfile(os.path.join(path, "config.json")), path
        super().load(path)

    update_weights = load


def test_applier_fetches_refuses_a_corrupted_byte_and_skips_a_pruned_version(served, redis_url, tmp_path):
    store, server = served
    r, keys = connect_redis(redis_url), Keys("http")
    cache = tmp_path / "cache"
    fetcher = WeightFetcher(HttpTransport(cache_dir=str(cache), advertise_url=server.base_url), keep=2)
    backend = StubBackend()
    weights = WeightApplier(r, keys, backend, "g", fetcher=fetcher)

    def publish(v):
        a = _publish(store, v, 200_000)
        a.url = server.url(v)
        announce(r, keys, a)
        return a

    publish(1)
    weights.update(block=True)
    assert weights.version == 1 and backend.loaded == [str(cache / "v000001")]

    # a byte of version 2 altered on the server after sealing: refused, version 1 keeps serving
    a2 = publish(2)
    f = weightstore.version_dir(store, 2) / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[100_000] ^= 1
    f.write_bytes(bytes(data))
    weights.update()
    assert weights.version == 1 and weights.refused == {a2.hash: "corrupt_file"} and weights.refused_updates == 1
    assert not (cache / "v000002").exists()
    refused = [e for _, e in read_events(r, keys, None, 100) if e.kind == "refused"]
    assert refused and refused[-1].data["reason"] == "corrupt_file" and refused[-1].data["version"] == 2

    # version 3 pruned between its announcement and its fetch (the learner moved on to 4): not refused
    real_fetch_kept = fetcher.fetch_kept

    def learner_moves_on(a, serving, keep=False):
        if a.version == 3:
            publish(4)
            shutil.rmtree(weightstore.version_dir(store, 3))
        return real_fetch_kept(a, serving, keep)

    fetcher.fetch_kept = learner_moves_on
    publish(3)
    weights.update()
    assert weights.version == 4 and weights.refused_updates == 1
    with pytest.raises(weightstore.WeightStoreError) as e:
        real_fetch_kept(Announcement(3, "0" * 64, "", url=server.url(3)))
    assert e.value.reason == "not_found"

    # the cache keeps the newest two and the one served
    for v in (5, 6, 7):
        publish(v)
        weights.update()
    assert weights.version == 7 and weightstore.list_versions(cache) == [6, 7]
    fetcher.prune({1})
    assert fetcher.fetched == 5  # 1, 4, 5, 6, 7 (2 refused, 3 pruned)


def _tensor_version(store, v: int, state: dict, digest: str, server) -> Announcement:
    """A version of real safetensors with its tensor digest; ``digest`` may be another version's."""
    from safetensors.torch import save_file

    staging = weightstore.staging_dir(store, v)
    (staging / "config.json").write_text("{}")
    save_file(state, str(staging / "model.safetensors"))
    path, h = weightstore.seal(store, v, staging)
    return Announcement(v, h, str(path), url=server.url(v), digest=digest)


def test_the_tensor_digest_is_checked_from_the_downloaded_bytes(served, redis_url, tmp_path):
    """The fetcher computes the tensors' digest while downloading (through two dropped connections too),
    and a tensor altered under a recomputed manifest (its hash checks) is refused as ``digest_mismatch``."""
    import torch

    from broker.protocol.tensordigest import state_digest

    store, server = served
    r, keys = connect_redis(redis_url), Keys("http-digest")
    good = {"w": torch.arange(400_000, dtype=torch.float32).reshape(800, 500), "b": torch.ones(7)}
    a1 = _tensor_version(store, 1, good, state_digest(good), server)
    proxy = FlakyProxy(server.http.server_address, b"model.safetensors", cut_after=700_000, drops=2)
    try:
        a1.url = f"http://127.0.0.1:{proxy.port}/v000001/"
        fetcher = WeightFetcher(HttpTransport(cache_dir=str(tmp_path / "cache"), port=proxy.port))
        weights = WeightApplier(r, keys, StubBackend(), "g", fetcher=fetcher)
        announce(r, keys, a1)
        weights.update(block=True)
    finally:
        proxy.close()
    assert proxy.cut == 2 and weights.version == 1 and weights.digest == state_digest(good)

    bad = dict(good, w=good["w"].clone())
    bad["w"][3, 4] += 1.0  # one weight changed; the manifest is recomputed over the altered file
    fetcher.base_url = server.base_url  # the proxy is gone: straight from the server
    announce(r, keys, _tensor_version(store, 2, bad, state_digest(good), server))
    weights.update()
    assert weights.version == 1 and weights.refused_updates == 1
    assert list(weights.refused.values()) == ["digest_mismatch"]
    refused = [e for _, e in read_events(r, keys, None, 100) if e.kind == "refused"]
    assert refused[-1].data["reason"] == "digest_mismatch" and refused[-1].data["version"] == 2


def test_a_resumed_learner_announces_the_latest_version_again_with_its_own_server(tmp_path, redis_url):
    """A learner resumed without publishing (learner/publish.py resumed_versions) serves the store from a new
    weight server (another port; the old learner's is gone): the latest version, and the version carrying the
    base model its adapter pins, are announced again with the new server's URL, the same versions, hashes and
    signatures' key, and a generator starting now fetches the latest from there."""
    import dataclasses

    from broker.client.announcements import latest_announcement, signed_announcement
    from learner.publish import Publisher
    from tests.support.services import announce_key

    store, key = tmp_path / "store", announce_key(tmp_path)
    store.mkdir()
    r, keys = connect_redis(redis_url), Keys("r")
    old = WeightServer(store).start()
    a2, a3 = _publish(store, 2, 1000), _publish(store, 3, 1000)
    for a in (a2, a3):  # version 3 an adapter on version 2's base, as LoRA runs publish them
        announce(r, keys, dataclasses.replace(a, url=old.url(a.version), base=2, base_digest="b" * 64), key)
    old.close()
    new = WeightServer(store).start()
    try:
        assert new.base_url != old.base_url
        pub = Publisher(r, keys, str(store), None, 4, key)
        pub.url_for = new.url
        pub.readvertise(latest_announcement(r, keys, key))
        latest = latest_announcement(r, keys, key)
        assert (latest.version, latest.hash, latest.url) == (3, a3.hash, new.url(3))
        assert signed_announcement(r, keys, 2, key).url == new.url(2)
        # a generator configured with the new server (relay up pins the port; a moved one is in its config)
        fetched = WeightFetcher(HttpTransport(cache_dir=str(tmp_path / "cache"), advertise_url=new.base_url)).fetch(
            latest
        )
        weightstore.check(fetched, a3.hash)  # the very files announced (WeightStoreError otherwise)
        assert fetched.name == "v000003"
    finally:
        new.close()
