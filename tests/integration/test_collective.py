"""The collective weight transport over real gloo groups between real processes (learner/broadcast.py,
generators/weight_receive.py): the learner's broadcaster in this process, generators' receivers in
subprocesses (tests/support/collective_peer.py), real Redis, the learner's rendezvous on a free port."""

import pytest
import torch

from broker.client.connection import connect_redis
from broker.client.telemetry import read_events
from broker.protocol.keys import Keys
from broker.protocol.tensordigest import state_digest
from broker.protocol.weights_config import CollectiveTransport
from learner.broadcast import Broadcaster
from learner.tiny_model import build_tiny_model
from tests.support.peers import moved_version, peer_result, start_peer
from tests.support.services import announce_key, wait_until, weights_key


def _peer(procs, redis_url, tmp_path, model, gid, *extra):
    return start_peer(procs, redis_url, tmp_path, model, gid, "coll", *extra)


def test_versions_reach_two_generators_and_a_corrupted_bucket_is_refused_not_served(redis_url, tmp_path, peers):
    model = build_tiny_model(tmp_path / "model")
    r, keys = connect_redis(redis_url), Keys("coll")
    # buckets of 64 KiB: the tiny model (~0.5 MiB in fp32) travels in several
    b = Broadcaster(
        r,
        keys,
        CollectiveTransport(bucket_mb=1 / 16, timeout_s=30),
        announce_key(tmp_path),
        weights_key=weights_key(tmp_path),
    ).start()
    try:
        good = _peer(peers, redis_url, tmp_path, model, "g-good", "--until", "2")
        bad = _peer(
            peers, redis_url, tmp_path, model, "g-bad", "--until", "2", "--until-refused", "1", "--flip-bucket", "2"
        )
        wait_until(lambda: b.member_ids() == ["g-bad", "g-good"], timeout=60, what="both generators joined")
        initial = state_digest(moved_version(model, 0.0))
        v1, v2 = moved_version(model, 0.01), moved_version(model, 0.02)
        assert b.send(1, v1) == state_digest(v1)
        # version 1 applied (and refused) before version 2 is sent: else a loaded machine may deliver both
        # before the generators look, and they apply only the newest
        wait_until(
            lambda: (
                {
                    (e.data["generator"], e.kind)
                    for _, e in read_events(r, keys, None, 100)
                    if e.data.get("version") == 1
                }
                >= {("g-good", "applied"), ("g-bad", "refused")}
            ),
            timeout=60,
            what="version 1 applied by g-good, refused by g-bad",
        )
        assert b.send(2, v2) == state_digest(v2)
        ok, flipped = peer_result(good, tmp_path, "g-good"), peer_result(bad, tmp_path, "g-bad")
    finally:
        b.close()
    # the healthy generator serves exactly what was sent, through the collective
    assert ok["version"] == 2 and ok["via"] == "collective" and ok["collective_updates"] == 2
    assert ok["engine_digest"] == ok["digest"] == state_digest(v2)
    assert ok["refused_updates"] == 0
    # the one whose bucket 2 of version 1 was altered in flight refused version 1 (its weights stayed the
    # initial ones meanwhile: checked below through the events), flagged it, and then applied version 2
    assert flipped["flipped"] == [2]
    assert flipped["refused_updates"] == 1
    assert list(flipped["refused"].values()) == ["digest_mismatch"]
    assert flipped["version"] == 2 and flipped["engine_digest"] == state_digest(v2)
    events = [e for _, e in read_events(r, keys, None, 100)]
    refused = [e.data for e in events if e.kind == "refused"]
    assert refused == [
        {
            "generator": "g-bad",
            "version": 1,
            "reason": "digest_mismatch",
            "via": "collective",
            "digest": refused[0]["digest"],
        }
    ]
    assert refused[0]["digest"] != state_digest(v1)
    applied = [
        (e.data["generator"], e.data["version"], e.data["digest"], e.data["via"]) for e in events if e.kind == "applied"
    ]
    assert sorted(applied) == [
        ("g-bad", 2, state_digest(v2), "collective"),
        ("g-good", 1, state_digest(v1), "collective"),
        ("g-good", 2, state_digest(v2), "collective"),
    ]
    assert initial != state_digest(v1)


def test_a_version_with_a_nan_is_aborted_on_the_wire_and_never_applied(redis_url, tmp_path, peers):
    """The learner checks finiteness beside the broadcast (off its own path): a version with a NaN goes
    out, then its trailer aborts it; the generator discards it without flagging anything (it is no attack)
    and applies the next good version. The same for a streamed snapshot whose copy fails half way; a
    streamed snapshot that fills slowly, bucket after bucket, arrives whole."""
    import threading
    import time

    from learner.publish import NonFiniteWeights, Progress, fill, refuse_nonfinite

    model = build_tiny_model(tmp_path / "model")
    r, keys = connect_redis(redis_url), Keys("coll")
    b = Broadcaster(
        r,
        keys,
        CollectiveTransport(bucket_mb=1 / 16, timeout_s=30),
        announce_key(tmp_path),
        weights_key=weights_key(tmp_path),
    ).start()

    def streamed(version: int, source: dict, missing: str = "") -> tuple[str, list[str]]:
        """Send ``version`` while another thread fills it tensor by tensor (as the learner's snapshot does),
        its copy failing at tensor ``missing``; the digest sent and the tensors the copy read."""
        buffers = b.buffers(source, torch.float32)
        source = {k: v for k, v in source.items() if k != missing}
        progress, seen = Progress(), []

        def copy() -> None:
            class Slow(dict):  # each tensor a little late: the broadcast must wait for it, not send zeros
                def __getitem__(self, k):
                    time.sleep(0.01)
                    seen.append(k)
                    return dict.__getitem__(self, k)

            try:
                fill(buffers, Slow(source), progress)
            except KeyError:
                pass  # the failing copy below: the broadcast aborts the version

        t = threading.Thread(target=copy)
        t.start()
        try:
            return b.send(
                version, buffers, check=lambda: (progress.wait(), refuse_nonfinite(buffers, version)), progress=progress
            ), seen
        finally:
            t.join()

    try:
        gen = _peer(peers, redis_url, tmp_path, model, "g-0", "--until", "3")
        wait_until(lambda: b.member_ids() == ["g-0"], timeout=60, what="the generator joined")
        v1, v2, v3 = moved_version(model, 0.01), moved_version(model, 0.02), moved_version(model, 0.03)
        v1["model.norm.weight"][3] = float("nan")
        with pytest.raises(NonFiniteWeights, match="version 1.*model.norm.weight"):
            b.send(1, v1, check=lambda: refuse_nonfinite(v1, 1))
        with pytest.raises(ValueError, match="copy failed"):
            streamed(2, v2, missing="model.layers.0.mlp.up_proj.weight")  # half way through the buckets
        digest, seen = streamed(3, v3)
        assert digest == state_digest(v3) and sorted(seen) == sorted(v3)
        out = peer_result(gen, tmp_path, "g-0")
    finally:
        b.close()
    assert out["version"] == 3 and out["collective_updates"] == 1 and out["engine_digest"] == state_digest(v3)
    assert out["refused_updates"] == 0 and b.member_ids() == []  # closed; it was never dropped
    assert b.dropped == 0
    events = [e for _, e in read_events(r, keys, None, 100)]
    assert [(e.kind, e.data["version"]) for e in events if e.kind in ("applied", "refused")] == [("applied", 3)]


def test_a_refused_version_leaves_the_engine_weights_unchanged(redis_url, tmp_path, peers):
    """Only the corrupted version is sent: the generator must still serve its initial weights, bit for bit."""
    model = build_tiny_model(tmp_path / "model")
    r, keys = connect_redis(redis_url), Keys("coll")
    b = Broadcaster(
        r,
        keys,
        CollectiveTransport(bucket_mb=1 / 16, timeout_s=30),
        announce_key(tmp_path),
        weights_key=weights_key(tmp_path),
    ).start()
    try:
        bad = _peer(
            peers, redis_url, tmp_path, model, "g-bad", "--until", "0", "--until-refused", "1", "--flip-bucket", "0"
        )
        wait_until(lambda: b.member_ids() == ["g-bad"], timeout=60, what="the generator joined")
        b.send(1, moved_version(model, 0.01))
        res = peer_result(bad, tmp_path, "g-bad")
    finally:
        b.close()
    assert res["refused_updates"] == 1 and res["version"] == 0 and res["collective_updates"] == 0
    assert res["engine_digest"] == state_digest(moved_version(model, 0.0))  # not served: the weights are unchanged


def test_a_dead_generator_leaves_at_once_and_the_others_still_receive(redis_url, tmp_path, peers):
    """A generator killed between two versions: its rendezvous connection ends with its process, so the learner
    drops it before the next broadcast (no wait of timeout_s for it), and frees its id."""
    model = build_tiny_model(tmp_path / "model")
    r, keys = connect_redis(redis_url), Keys("coll")
    b = Broadcaster(
        r,
        keys,
        CollectiveTransport(bucket_mb=1 / 16, timeout_s=10),
        announce_key(tmp_path),
        weights_key=weights_key(tmp_path),
    ).start()
    try:
        alive = _peer(peers, redis_url, tmp_path, model, "g-alive", "--until", "2")
        dead = _peer(peers, redis_url, tmp_path, model, "g-dead", "--until", "99")
        wait_until(lambda: b.member_ids() == ["g-alive", "g-dead"], timeout=60, what="both generators joined")
        b.send(1, moved_version(model, 0.01))
        dead.kill()  # SIGKILL between two versions
        dead.wait()
        wait_until(lambda: b.member_ids() == ["g-alive"], timeout=10, what="the dead generator left")
        assert "g-dead" not in b.rendezvous.ids  # a restarted g-dead may join again
        v2 = moved_version(model, 0.02)
        assert b.send(2, v2) == state_digest(v2)
        res = peer_result(alive, tmp_path, "g-alive")
    finally:
        b.close()
    assert res["version"] == 2 and res["engine_digest"] == state_digest(v2)
    assert b.member_ids() == [] and b.dropped == 0  # closed; g-dead left before version 2, no broadcast waited for it
    left = [e.data["generator"] for _, e in read_events(r, keys, None, 100) if e.kind == "collective_left"]
    assert left[0] == "g-dead" and set(left) <= {"g-dead", "g-alive"}  # g-alive leaves too once it exits


def test_groups_of_a_version_applied_before_its_announcement_get_the_announced_hash(redis_url, tmp_path):
    """WeightApplier.hash_for (the sink and the heartbeat use it): the manifest hash once the signed
    announcement exists, "" before (the heartbeat) or when its digest is not the one applied."""
    import threading
    import time

    from broker.client.announcements import announce
    from broker.protocol.messages import Announcement
    from generators.weights import WeightApplier

    r, keys, key = connect_redis(redis_url), Keys("coll"), announce_key(tmp_path)
    w = WeightApplier(r, keys, backend=None, generator_id="g", announce_key=key)
    w.version, w.hash, w.received.applied_digests = 5, "", {5: "d5", 6: "d6"}
    assert w.hash_for(5, wait_s=0) == ""  # not announced yet: the heartbeat says nothing
    later = threading.Timer(0.3, announce, (r, keys, Announcement(version=5, hash="h5", path="/p5", digest="d5"), key))
    later.start()
    t0 = time.monotonic()
    assert w.hash_for(5, wait_s=10) == "h5"  # the sink waits for it
    assert 0.2 < time.monotonic() - t0 < 5
    announce(r, keys, Announcement(version=6, hash="h6", path="/p6", digest="other"), key)
    assert w.hash_for(6, wait_s=0) == ""  # announced with another digest than the one applied: never vouched for
    announce(r, keys, Announcement(version=7, hash="h7", path="/p7", digest="d7"), None)  # unsigned: not ours
    assert w.hash_for(7, wait_s=0) == ""
