"""The ipc weight transport between real processes on this host (learner/ipc.py, generators/ipc_receive.py):
the learner's sharer in this process, generators' receivers in subprocesses (tests/support/collective_peer.py
``--transport ipc``), real Redis, real POSIX shared memory on CPU and real CUDA IPC on a GPU (``gpu``)."""

import json
from pathlib import Path

import pytest
import torch

from broker.client.connection import connect_redis
from broker.client.telemetry import read_events
from broker.protocol import ipc
from broker.protocol.keys import Keys
from broker.protocol.tensordigest import state_digest
from generators.config import TorchBackendConfig
from generators.ipc_receive import IpcReceiver
from generators.weights import WeightApplier
from learner.ipc import IpcSharer
from learner.publish import NonFiniteWeights, refuse_nonfinite
from learner.tiny_model import build_tiny_model
from tests.support.models import needs_gpu
from tests.support.peers import moved_version, peer_result, start_peer
from tests.support.services import announce_key, child_env, relay, relay_up_args, wait_until

RUN = "ipc"


def _peer(procs, redis_url, tmp_path, model, gid, *extra):
    return start_peer(procs, redis_url, tmp_path, model, gid, RUN, "--transport", "ipc", *extra)


def _events(r, keys, kind):
    return [e.data for _, e in read_events(r, keys, None, 200) if e.kind == kind]


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("relay-ipc-*")}


def test_versions_reach_two_generators_and_a_corrupted_copy_is_refused_not_served(redis_url, tmp_path, peers):
    model = build_tiny_model(tmp_path / "model")
    r, keys = connect_redis(redis_url), Keys(RUN)
    before = _segments()
    sharer = IpcSharer(r, keys, announce_key(tmp_path)).start()
    try:
        v1, v2 = moved_version(model, 0.01), moved_version(model, 0.02)
        # the slots exist (and are advertised) from the first version on: the peers map them when it appears
        good = _peer(peers, redis_url, tmp_path, model, "g-good", "--until", "2")
        bad = _peer(
            peers, redis_url, tmp_path, model, "g-bad", "--until", "2", "--until-refused", "1", "--flip-bucket", "0"
        )
        assert sharer.send(1, v1) == state_digest(v1)
        assert len(_segments() - before) == 2  # two slots, as POSIX shared memory on the CPU
        wait_until(
            lambda: (
                {
                    (e["generator"], k)
                    for k in ("applied", "refused")
                    for e in _events(r, keys, k)
                    if e.get("version") == 1
                }
                >= {("g-good", "applied"), ("g-bad", "refused")}
            ),
            timeout=90,
            what="version 1 applied by g-good, refused by g-bad",
        )
        assert sharer.send(2, v2) == state_digest(v2)
        ok, flipped = peer_result(good, tmp_path, "g-good"), peer_result(bad, tmp_path, "g-bad")
    finally:
        sharer.close()
    assert _segments() - before == set()  # unlinked by close()
    assert r.exists(keys.ipc) == 0
    # the healthy generator serves exactly what was shared, through ipc
    assert ok["version"] == 2 and ok["via"] == "ipc" and ok["collective_updates"] == 2
    assert ok["engine_digest"] == ok["digest"] == state_digest(v2) and ok["refused_updates"] == 0
    # the one whose copy of version 1 was altered refused it, flagged it, then applied version 2
    assert flipped["flipped"] == [0] and flipped["refused_updates"] == 1
    assert list(flipped["refused"].values()) == ["digest_mismatch"]
    assert flipped["version"] == 2 and flipped["engine_digest"] == state_digest(v2)
    refused = _events(r, keys, "refused")
    assert [(e["generator"], e["version"], e["reason"], e["via"]) for e in refused] == [
        ("g-bad", 1, "digest_mismatch", "ipc")
    ]
    applied = sorted((e["generator"], e["version"], e["digest"], e["via"]) for e in _events(r, keys, "applied"))
    assert applied == [
        ("g-bad", 2, state_digest(v2), "ipc"),
        ("g-good", 1, state_digest(v1), "ipc"),
        ("g-good", 2, state_digest(v2), "ipc"),
    ]


def _in_process(r, keys, model, key, device="cpu", **hooks):
    backend = TorchBackendConfig(device=device).build()
    backend.load(str(model))
    receiver = IpcReceiver(r, keys, "g-0", key, device=device, **hooks)
    w = WeightApplier(r, keys, backend, "g-0", announce_key=key, receiver=receiver)
    w.version = 0  # the initial weights, as if loaded from the store
    return backend, receiver, w


def _serve_until(w, version: int, timeout: float = 60.0) -> None:
    def step():
        w.update()
        return w.version >= version

    wait_until(step, timeout=timeout, what=f"version {version} served")


def test_a_slot_rewritten_during_the_copy_is_discarded_not_refused_and_the_newest_is_applied(redis_url, tmp_path):
    """The seqlock: the learner moves two versions on while a generator copies version 1 (so version 3
    lands in version 1's slot mid-copy). The torn copy is neither applied nor refused; version 3 is."""
    model = build_tiny_model(tmp_path / "model")
    r, keys, key = connect_redis(redis_url), Keys(RUN), announce_key(tmp_path)
    sharer = IpcSharer(r, keys, key).start()
    vs = {v: moved_version(model, 0.01 * v) for v in (1, 2, 3)}
    moved = []

    def learner_moves_on() -> None:
        if not moved:
            moved.append(1)
            sharer.send(2, vs[2])
            sharer.send(3, vs[3])

    backend, receiver, w = _in_process(r, keys, model, key, after_copy=learner_moves_on)
    try:
        sharer.send(1, vs[1])
        receiver.start()
        _serve_until(w, 3)
    finally:
        receiver.close()
        sharer.close()
    assert moved and receiver.superseded >= 1
    assert w.version == 3 and w.refused_updates == 0 and w.collective_updates == 1
    served = {k: v for k, v in backend.model.state_dict().items() if k != "lm_head.weight"}
    assert state_digest(served) == state_digest(vs[3])
    assert [e["version"] for e in _events(r, keys, "applied")] == [3]


def test_a_version_is_copied_while_the_learner_digests_it_and_applied_only_once_current_confirms_it(
    redis_url, tmp_path, monkeypatch
):
    """``staged`` lets a generator copy and digest a version beside the learner's own digest: while the
    learner is still digesting (held here until the generator's copy is made), nothing is applied; once
    ``current`` is signed, the copy made ahead is the one applied (one copy, not two)."""
    import learner.ipc as sharing

    model = build_tiny_model(tmp_path / "model")
    r, keys, key = connect_redis(redis_url), Keys(RUN), announce_key(tmp_path)
    sharer = IpcSharer(r, keys, key).start()
    copies = []
    backend, receiver, w = _in_process(r, keys, model, key, after_copy=lambda: copies.append(1))
    v1, v2 = moved_version(model, 0.01), moved_version(model, 0.02)
    applied_meanwhile = []
    digest = sharing.state_digest

    def learner_digest(state, algorithm):  # the learner's digest of version 2, slower than the generator's copy
        if copies and state_digest(state) == state_digest(v2):
            wait_until(lambda: receiver._pending is not None, timeout=30, what="version 2 copied ahead")
            w.update()
            applied_meanwhile.append(w.version)
        return digest(state, algorithm)

    try:
        sharer.send(1, v1)
        receiver.start()
        _serve_until(w, 1)
        monkeypatch.setattr(sharing, "state_digest", learner_digest)
        assert sharer.send(2, v2) == state_digest(v2)
        _serve_until(w, 2)
    finally:
        receiver.close()
        sharer.close()
    assert applied_meanwhile == [1]  # copied, not applied: current had not confirmed it yet
    assert len(copies) == 2  # version 1, then version 2 once, ahead of its current entry
    served = {k: v for k, v in backend.model.state_dict().items() if k != "lm_head.weight"}
    assert state_digest(served) == state_digest(v2) and w.refused_updates == 0


def test_forged_current_entry_is_refused_and_a_nan_version_never_shared(redis_url, tmp_path):
    """Whoever can write to Redis cannot make a generator apply weights: a ``current`` entry pointing at
    the slot with a digest the run's key did not sign is refused (bad_signature). A version with a NaN is
    refused before its slot is announced (the publisher's finiteness check): nothing is shared."""
    model = build_tiny_model(tmp_path / "model")
    r, keys, key = connect_redis(redis_url), Keys(RUN), announce_key(tmp_path)
    sharer = IpcSharer(r, keys, key).start()
    backend, receiver, w = _in_process(r, keys, model, key)
    try:
        v1 = moved_version(model, 0.01)
        sharer.send(1, v1)
        receiver.start()
        _serve_until(w, 1)
        cur = ipc.parse_current(r.hget(keys.ipc, "current"))
        r.hset(
            keys.ipc,
            "current",
            ipc.encode_current(2, cur["slot"], cur["seq"], cur["epoch"], cur["digest"], cur["header_sha256"], "0" * 64),
        )
        wait_until(lambda: (w.update(), w.refused_updates)[1] == 1, timeout=30, what="the forged entry refused")
        bad = moved_version(model, 0.03)
        bad["model.norm.weight"][0] = float("nan")
        with pytest.raises(NonFiniteWeights):
            sharer.send(3, bad, check=lambda: refuse_nonfinite(bad, 3))
        assert ipc.parse_current(r.hget(keys.ipc, "current"))["version"] == 2  # the forged one, still
    finally:
        receiver.close()
        sharer.close()
    assert w.version == 1 and list(w.refused.values()) == ["bad_signature"]
    assert [(e["version"], e["reason"]) for e in _events(r, keys, "refused")] == [(2, "bad_signature")]


def test_cuda_ipc_hands_bf16_weights_to_a_torch_generator_process(redis_url, tmp_path, peers):
    """On a GPU: the learner's weights on the device are staged into a slot of its GPU memory (stage, in
    the learner's thread) and a torch-backend generator process on the same GPU copies them device to
    device through CUDA IPC, checks the digest and serves them."""
    model = build_tiny_model(tmp_path / "model")
    r, keys = connect_redis(redis_url), Keys(RUN)
    sharer = IpcSharer(r, keys, announce_key(tmp_path)).start()
    try:
        g = _peer(peers, redis_url, tmp_path, model, "g-cuda", "--until", "3", "--device", "cuda")
        for v in (1, 2, 3):
            weights = moved_version(model, 0.01 * v, device="cuda")
            sharer.stage(v, weights, torch.bfloat16, tied=False)
            snapshot = {k: t.to("cpu", torch.bfloat16) for k, t in weights.items()}
            assert sharer.send(v, snapshot) == state_digest(snapshot)
            wait_until(
                lambda: any(e["version"] == v for e in _events(r, keys, "applied")),
                timeout=120,
                what=f"version {v} applied",
            )
        out = peer_result(g, tmp_path, "g-cuda")
    finally:
        sharer.close()
    assert sharer.slots == [] and out["version"] == 3 and out["via"] == "ipc" and out["refused_updates"] == 0
    assert out["digest"] == state_digest(snapshot)


def test_relay_up_with_ipc_on_a_gpu_applies_every_version_through_cuda_ipc(tmp_path, redis_url):
    """The whole run on a GPU: the DeepSpeed learner on the device stages each version into its slots,
    two torch-backend generators on the same device copy them through CUDA IPC; every version applied
    via ipc has the announced digest, nothing is refused or lost."""
    env = {k: v for k, v in child_env().items() if k != "DS_ACCELERATOR"}  # the learner on the GPU too
    res = relay(
        *relay_up_args(
            tmp_path,
            RUN,
            "--redis-url",
            redis_url,
            steps=40,
            sets=(
                "weights.transport=ipc",
                "generator.backend.device=cuda",
            ),
        ),
        timeout=900,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r, keys = connect_redis(redis_url), Keys(RUN)
    events = [e for _, e in read_events(r, keys, None, 100_000)]
    published = {e.data["version"]: e.data for e in events if e.kind == "published"}
    assert sorted(published) == list(range(41))
    assert not [e.data for e in events if e.kind == "refused"]
    for gid in ("gen-0", "gen-1"):
        applied = [e.data for e in events if e.kind == "applied" and e.data["generator"] == gid]
        via_ipc = {a["version"] for a in applied if a["via"] == "ipc"}
        assert len(via_ipc) >= 10, (gid, [(a["version"], a["via"]) for a in applied])
        assert all(a["digest"] == published[a["version"]]["digest"] for a in applied), gid
        log = (tmp_path / RUN / "logs" / f"{gid}.log").read_text()
        assert "mapped the learner's ipc slots" in log and "on cuda" in log, log[-2000:]
    summary = json.loads((tmp_path / RUN / "summary.json").read_text())
    assert summary["audit"]["lost"] == 0, summary["audit"]


for _mark in needs_gpu():  # marked gpu, skipped (saying why) where torch sees no GPU
    test_cuda_ipc_hands_bf16_weights_to_a_torch_generator_process = _mark(
        test_cuda_ipc_hands_bf16_weights_to_a_torch_generator_process
    )
    test_relay_up_with_ipc_on_a_gpu_applies_every_version_through_cuda_ipc = _mark(
        test_relay_up_with_ipc_on_a_gpu_applies_every_version_through_cuda_ipc
    )
