"""A torch generator as a real process against real Redis, broker and reward service: its groups
carry exact behaviour log-probs, it applies new versions in place, and refuses corrupt ones."""

import json
import time

import redis
import torch

from broker import client
from broker.keys import Keys
from broker.protocol import decode_group
from broker.sampling import sampling_logprobs
from deploy.procs import free_port
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.conftest import start_service, wait_http, wait_until


def test_generator_samples_exact_logprobs_and_updates_in_place(procs, redis_url, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ingest, http, reward = free_port(), free_port(), free_port()
    b = start_service(procs, "broker", "broker", {"run_id": "t", "redis_url": redis_url, "http_port": http,
                                                   "ingest_bind": f"tcp://127.0.0.1:{ingest}", "prompt_backlog": 8},
                      tmp_path)
    rw = start_service(procs, "reward", "reward", {"port": reward}, tmp_path)
    wait_http(f"http://127.0.0.1:{http}/healthz", b)
    wait_http(f"http://127.0.0.1:{reward}/healthz", rw)

    r, keys = redis.Redis.from_url(redis_url), Keys("t")
    path = build_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path)
    pub = Publisher(r, keys, str(tmp_path / "weights"), AutoTokenizer.from_pretrained(path), keep_versions=10)
    a0 = pub.publish(model, model.state_dict(), 0)

    gen = start_service(procs, "gen", "generator", {
        "id": "g0", "run_id": "t", "redis_url": redis_url, "broker_address": f"tcp://127.0.0.1:{ingest}",
        "reward_url": f"http://127.0.0.1:{reward}", "prompts_per_batch": 2, "sampling": {"n": 4, "max_tokens": 6},
        "exit_when_done": True}, tmp_path)
    entries = wait_until(lambda: r.xrange(keys.trajectories, count=2) if r.xlen(keys.trajectories) >= 2 else None,
                         what=f"groups from the generator:\n{gen.tail()}")
    g = decode_group(entries[0][1][b"data"])
    assert g.weight_version == 0 and g.weight_hash == a0.hash and len(g.samples) == 4
    # behaviour log-probs equal the learner's recomputation on the same weights
    for s in g.samples:
        assert s.version_runs == [[0, len(s.completion_ids)]]
        ids = torch.tensor([g.prompt_ids.tolist() + s.completion_ids.tolist()])
        with torch.no_grad():
            lp = sampling_logprobs(model(ids).logits[:, :-1], temperature=1.0)
        recomputed = lp[0, len(g.prompt_ids) - 1:].gather(-1, ids[0, len(g.prompt_ids):, None]).squeeze(-1)
        assert torch.allclose(recomputed, torch.from_numpy(s.logprobs.copy()), atol=1e-4)
        assert s.reward_status == "ok" and 0.0 <= s.reward <= 1.0

    # a new version is applied in place (same process) and reported with its hash
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    a1 = pub.publish(model, model.state_dict(), 1)
    hb = wait_until(lambda: (h := client.generators(r, keys).get("g0")) and h["version"] == 1 and h,
                    what="version 1 applied")
    assert hb["hash"] == a1.hash and hb["updates"] == 2 and gen.alive()

    # a snapshot corrupted after its announcement is refused; version 1 keeps serving, visibly
    import broker.weightstore as ws
    from broker.protocol import Announcement

    staging = ws.staging_dir(tmp_path / "weights", 2)
    for f in ws.version_dir(tmp_path / "weights", 1).iterdir():
        if f.name != ws.MANIFEST:
            (staging / f.name).write_bytes(f.read_bytes())
    p2, h2 = ws.seal(tmp_path / "weights", 2, staging)
    with open(p2 / "model.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xff\xff\xff")
    client.announce(r, keys, Announcement(2, h2, str(p2)))
    hb = wait_until(lambda: (h := client.generators(r, keys).get("g0")) and h["refused_updates"] >= 1 and h,
                    what="refusal reported")
    assert hb["version"] == 1 and hb["hash"] == a1.hash and hb["refused"] == {h2: "corrupt_file"}
    time.sleep(1.0)
    newer = [decode_group(f[b"data"]) for _, f in r.xrange(keys.trajectories)][-1]
    assert newer.weight_version == 1  # still sampling with the previous version
    assert "refused weight version 2 (corrupt_file)" in gen.log_path.read_text()
    events = [json.loads(e[b"data"]) for _, e in r.xrange(keys.events) if e[b"kind"] == b"refused"]
    assert events and events[0]["reason"] == "corrupt_file"
