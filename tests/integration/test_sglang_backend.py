"""The sglang backend in a generator process, against a local server that mirrors SGLang's HTTP
shapes (tests/support/sglang_mock_server.py cites the SGLang source files): groups carry the server's
log-probs, which equal the learner's recomputation; a new version is pushed to the server with
/update_weights_from_disk and its weight_version, in place."""

import json
import sys

import pytest
import redis
import torch

from broker.client import queues
from broker.client.telemetry import read_heartbeats
from broker.protocol.keys import Keys
from deploy.launcher.procs import free_port
from generators.config import GeneratorConfig
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.support.models import recompute_logprobs
from tests.support.services import ROOT, announce_key, child_env, start_service, wait_http, wait_until


@pytest.mark.slow  # a run of several services: left to `make test` (docs/testing.md)
def test_sglang_backend_against_sglang_shaped_server(procs, redis_url, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r, keys = redis.Redis.from_url(redis_url), Keys("t")
    path = build_tiny_model(tmp_path / "model")
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

    sgl_port, ingest, http, reward = free_port(), free_port(), free_port(), free_port()
    log = tmp_path / "sglang_requests.jsonl"
    sgl = procs.start(
        "sglang",
        [
            sys.executable,
            str(ROOT / "tests" / "support" / "sglang_mock_server.py"),
            "--model",
            str(path),
            "--port",
            str(sgl_port),
            "--log",
            str(log),
        ],
        env=child_env(),
        cwd=str(ROOT),
    )
    b = start_service(
        procs,
        "broker",
        "broker",
        {
            "run_id": "t",
            "redis_url": redis_url,
            "http_port": http,
            "ingest_bind": f"tcp://127.0.0.1:{ingest}",
            "prompt_backlog": 8,
        },
        tmp_path,
    )
    rw = start_service(procs, "reward", "reward", {"port": reward}, tmp_path)
    for url, child in (
        (f"http://127.0.0.1:{sgl_port}/get_model_info", sgl),
        (f"http://127.0.0.1:{http}/healthz", b),
        (f"http://127.0.0.1:{reward}/healthz", rw),
    ):
        wait_http(url, child)
    start_service(
        procs,
        "gen",
        "generator",
        {
            "id": "g0",
            "run_id": "t",
            "redis_url": redis_url,
            "broker_address": f"tcp://127.0.0.1:{ingest}",
            "reward_url": f"http://127.0.0.1:{reward}",
            "prompts_per_batch": 2,
            "sampling": {"n": 4, "max_tokens": 6, "temperature": 0.8},
            "backend": {"type": "sglang", "url": f"http://127.0.0.1:{sgl_port}"},
        },
        tmp_path,
    )

    g = wait_until(lambda: queues.read_groups(r, keys, count=1), what="a group from the generator")[0][1]
    assert g.weight_version == 0 and g.weight_hash == a0.hash and len(g.samples) == 4
    for s in g.samples:
        recomputed = recompute_logprobs(model, g.prompt_ids.tolist(), s.completion_ids.tolist(), temperature=0.8)
        assert torch.allclose(recomputed, torch.from_numpy(s.logprobs.copy()), atol=1e-4)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    a1 = pub.publish(model, model.state_dict(), 1)
    hb = wait_until(
        lambda: (h := read_heartbeats(r, keys).get("g0")) and h.version == 1 and h, what="version 1 applied"
    )
    assert hb.hash == a1.hash and hb.backend == "sglang" and hb.engine["weight_version"] == "1"

    requests = [json.loads(line) for line in log.read_text().splitlines()]
    updates = [q["body"] for q in requests if q["route"] == "/update_weights_from_disk"]
    assert [u["weight_version"] for u in updates] == ["0", "1"] and updates[1]["model_path"] == a1.path
    gen_req = next(
        q["body"]
        for q in requests  # training batches (evaluation rounds are greedy: temperature 0)
        if q["route"] == "/generate" and q["body"]["sampling_params"]["temperature"] == 0.8
    )
    assert gen_req["return_logprob"] is True and gen_req["sampling_params"]["stop_token_ids"] == [2]
    assert len(gen_req["input_ids"]) == 8 and all(isinstance(x, int) for x in gen_req["input_ids"][0])


def test_sglang_backend_refuses_filters_it_cannot_report():
    with pytest.raises(ValueError, match="temperature only"):
        GeneratorConfig(backend={"type": "sglang"}, sampling={"top_k": 5})
    with pytest.raises(ValueError, match="'finish' only"):
        GeneratorConfig(backend={"type": "sglang"}, in_flight="continue")
