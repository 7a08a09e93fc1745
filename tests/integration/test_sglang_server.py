"""The sglang backend against a real SGLang server (0.5.23, CPU, from SGLang's own environment: make test-sglang):
the backend starts ``sglang.launch_server`` on the tiny model's first weight version and drives it over HTTP.
Behaviour log-probs equal the learner's recomputation (temperature; top-k and top-p renormalised; greedy), new
versions are loaded in place (the same server process, the version SGLang reports), and in-flight "continue"
stamps each token with the version that sampled it."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import redis
import torch

from broker.protocol.keys import Keys
from deploy.launcher.procs import ProcessGroup, free_port, start_redis
from generators.backends.sglang import SGLangError
from generators.config import SamplingConfig, SGLangBackendConfig
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.support.models import recompute_logprobs
from tests.support.services import announce_key
from tests.support.sglang_env import needs_sglang, sglang_python

pytestmark = needs_sglang()

TOL = 1e-3  # the bound of issue 42 (float32 on both sides)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tmp_path_factory.mktemp("sglang")
    group = ProcessGroup(tmp / "logs")
    _, url = start_redis(group, tmp, free_port())
    path = build_tiny_model(tmp / "model", vllm_compatible=True)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pub = Publisher(
        redis.Redis.from_url(url),
        Keys("t"),
        str(tmp / "weights"),
        tok,
        keep_versions=10,
        announce_key=announce_key(tmp),
    )
    a0 = pub.publish(model, model.state_dict(), 0)
    backend = SGLangBackendConfig(launch={"python": str(sglang_python())}).build()
    try:
        backend.load(a0.path)
        yield SimpleNamespace(backend=backend, model=model, pub=pub, tok=tok, versions={0: a0})
    finally:
        backend.close()
        group.stop(timeout=5)
    assert backend.server.proc.poll() is not None  # the server is gone with its backend


def prompts(s) -> list[list[int]]:
    return [s.tok("4731=")["input_ids"], s.tok("82=")["input_ids"]]


def perturbed(model, scale: float):
    import copy

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(int(scale * 1000))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return m


def assert_logprobs(model, prompt, c, **sampling):
    recomputed = recompute_logprobs(model, prompt, c.token_ids, **sampling)
    got = torch.tensor(c.logprobs)
    assert torch.allclose(recomputed, got, atol=TOL), (recomputed - got).abs().max()


def test_first_version_logprobs_equal_the_learners(served):
    s = served
    assert s.backend.engine_info()["weight_version"] == "0"
    ps = prompts(s)
    groups = s.backend.generate(ps, SamplingConfig(n=4, temperature=0.8, max_tokens=6), seed=1)
    assert [len(g) for g in groups] == [4, 4]
    for p, g in zip(ps, groups):
        for c in g:
            assert 1 <= len(c.token_ids) <= 6 and c.versions is None
            assert c.finish_reason == ("stop" if c.token_ids[-1] == s.backend.eos_token_id else "length")
            assert_logprobs(s.model, p, c, temperature=0.8)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.7)])
def test_top_k_top_p_logprobs_are_of_the_distribution_sampled(served, top_k, top_p):
    s = served
    ps = prompts(s)
    sampling = SamplingConfig(n=8, temperature=1.2, top_k=top_k, top_p=top_p, max_tokens=6)
    kept = 0
    for p, g in zip(ps, s.backend.generate(ps, sampling, seed=2)):
        for c in g:
            assert_logprobs(s.model, p, c, temperature=1.2, top_k=top_k, top_p=top_p)
            kept += len(c.token_ids)
    assert kept > 0
    # SGLang's own log-prob within the kept set (return_sampling_mask), not top log-probs of the vocabulary
    (a,) = s.backend._request([ps[0]], sampling, 6)
    meta = a["meta_info"]
    assert len(meta["output_token_sampling_logprobs"]) == len(a["output_ids"]) > 0
    lens = [len(m) for m in meta["output_token_sampling_mask"]]  # the kept set's ids, one list per token
    assert not meta.get("output_top_logprobs") and all(1 <= n <= (top_k or s.backend.vocab_size) for n in lens)
    assert top_p == 1.0 or max(lens) < s.backend.vocab_size  # top-p 0.7 keeps fewer than all


def test_greedy_is_the_models_argmax(served):
    s = served
    p = prompts(s)[0]
    (g,) = s.backend.generate([p], SamplingConfig(n=2, top_k=1, max_tokens=5), seed=3)
    ids = list(p)
    with torch.no_grad():
        for _ in range(len(g[0].token_ids)):
            ids.append(int(s.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert g[0].token_ids == g[1].token_ids == ids[len(p) :] and g[0].logprobs == [0.0] * len(g[0].token_ids)


def test_new_versions_load_in_place(served):
    s = served
    pid = s.backend.engine_info()["server_pid"]
    for v in (1, 2):
        m = perturbed(s.model, 0.05 * v)
        s.versions[v] = a = s.pub.publish(m, m.state_dict(), v)
        s.backend.update_weights(a.path)
        info = s.backend.engine_info()
        assert info["server_pid"] == pid and info["weight_version"] == str(v)
        assert s.backend.http.get("/model_info").json()["weight_version"] == str(v)
        ps = prompts(s)
        for p, g in zip(ps, s.backend.generate(ps, SamplingConfig(n=4, temperature=1.0, max_tokens=6), seed=4)):
            for c in g:
                assert_logprobs(m, p, c)
                old = recompute_logprobs(s.model, p, c.token_ids)
                assert (old - torch.tensor(c.logprobs)).abs().max() > 10 * TOL  # the new weights do serve
    assert os.getpgid(pid) == pid  # still the server started first


def test_in_flight_continue_stamps_each_token_with_its_version(served):
    s = served
    models = {v: perturbed(s.model, 0.05 * v) for v in (3, 4)}
    for v, m in models.items():
        s.versions[v] = s.pub.publish(m, m.state_dict(), v)
    s.backend.update_weights(s.versions[3].path)
    calls = []

    def on_step() -> int:  # the generator's hook: version 4 arrives after the first chunk
        calls.append(1)
        if len(calls) == 2:
            s.backend.update_weights(s.versions[4].path)
        return 3 if len(calls) == 1 else 4

    chunk = s.backend.cfg.continue_chunk_tokens
    ps = prompts(s)
    groups = s.backend.generate(ps, SamplingConfig(n=4, temperature=1.0, max_tokens=3 * chunk), seed=5, on_step=on_step)
    switched = 0
    for p, g in zip(ps, groups):
        for c in g:
            assert c.versions == [3] * min(chunk, len(c.token_ids)) + [4] * max(0, len(c.token_ids) - chunk)
            for v in (3, 4):
                at = [i for i, x in enumerate(c.versions) if x == v]
                if at:
                    full = recompute_logprobs(models[v], p, c.token_ids)
                    assert torch.allclose(full[at], torch.tensor(c.logprobs)[at], atol=TOL)
            switched += 4 in c.versions
            assert c.finish_reason == ("stop" if c.token_ids[-1] == s.backend.eos_token_id else "length")
    assert switched > 0 and len(calls) >= 2


def test_tensor_updates_need_a_weight_update_session(served):
    """What 0.5.23 wants around /update_weights_from_tensor (the backend loads from disk, which needs none)."""
    body = {"serialized_named_tensors": [], "flush_cache": False}
    r = served.backend.http.post("/update_weights_from_tensor", json=body)
    assert r.status_code == 400 and "between begin_weight_update() and end_weight_update()" in r.json()["message"]


def test_the_launched_server_refuses_whoever_lacks_its_key(served):
    """A launched server always requires a key (here a fresh one: no generator.backend.api_key), kept off its
    command line and out of its log: a request without it, or with another, is refused (401) and changes
    nothing; the backend, which holds it, is served."""
    s = served
    s.backend.update_weights(s.versions[0].path)
    url, server = s.backend.engine_info()["url"], s.backend.server
    key = s.backend.http.headers["Authorization"].removeprefix("Bearer ")
    assert len(key) >= 40 and key == server.api_key
    cmdline = open(f"/proc/{server.pid}/cmdline", "rb").read().decode()
    assert key not in cmdline and "--api-key" not in cmdline
    assert server.output.redacted >= 1 and all(key not in line for line in server.output.tail)  # SGLang prints it
    other = perturbed(s.model, 0.5)
    s.versions[9] = a9 = s.pub.publish(other, other.state_dict(), 9)
    p = prompts(s)[0]
    for headers in ({}, {"Authorization": "Bearer " + key[:-1]}, {"Authorization": key}, {"X-API-Key": key}):
        r = httpx.post(
            f"{url}/update_weights_from_disk",
            json={"model_path": a9.path, "weight_version": "9", "flush_cache": True},
            headers=headers,
        )
        assert r.status_code == 401, (headers.keys(), r.status_code, r.text[:200])
        r = httpx.post(
            f"{url}/generate", json={"input_ids": p, "sampling_params": {"max_new_tokens": 2}}, headers=headers
        )
        assert r.status_code == 401, (headers.keys(), r.status_code, r.text[:200])
        assert httpx.get(f"{url}/model_info", headers=headers).status_code == 401
    assert s.backend.http.get("/model_info").json()["weight_version"] == "0"  # nothing changed
    (g,) = s.backend.generate([p], SamplingConfig(n=4, temperature=1.0, max_tokens=6), seed=9)
    for c in g:
        assert_logprobs(s.model, p, c)  # still version 0's weights
        assert (recompute_logprobs(other, p, c.token_ids) - torch.tensor(c.logprobs)).abs().max() > 10 * TOL
    assert httpx.get(f"{url}/health").status_code != 401  # SGLang leaves /health* and /metrics open


@pytest.mark.timeout(1200)  # a server of its own: 41 s to start at load 1, minutes at load 12-15
def test_a_top_k_generators_server_keeps_masks_of_top_k_ids(tmp_path, served):
    """A generator that samples with top-k launches its server with --sampling-mask-max-tokens = top_k: SGLang
    packs and copies a mask row of that many ids per sequence at every decode step, not one of the vocabulary
    (docs/generators.md, "the sampling mask's cost"). Its log-probs are still the learner's; a top-p request,
    whose mask would be the vocabulary, is refused naming the flag."""
    from generators.backends.sglang import MASK_CAP
    from generators.config import GeneratorConfig

    cfg = GeneratorConfig(backend={"type": "sglang", "launch": {"python": str(sglang_python())}}, sampling={"top_k": 5})
    backend = cfg.backend.build()
    try:
        backend.load(served.versions[0].path)
        argv = (Path("/proc") / str(backend.server.pid) / "cmdline").read_bytes().decode().split("\0")
        assert argv[argv.index(MASK_CAP) + 1] == "5"
        p = prompts(served)[0]
        sampling = SamplingConfig(n=8, temperature=1.2, top_k=5, max_tokens=6)
        (g,) = backend.generate([p], sampling, seed=3)
        for c in g:
            assert_logprobs(served.model, p, c, temperature=1.2, top_k=5)
        with pytest.raises(SGLangError, match="sampling-mask-max-tokens"):
            backend.generate([p], SamplingConfig(n=2, top_p=0.7, max_tokens=4), seed=3)
    finally:
        backend.close()
    assert backend.server.proc.poll() is not None


@pytest.mark.timeout(2400)  # two server starts: 57 s in all at load 6, over 9 min each at load 12-15 (6 Dec 2026)
def test_a_port_taken_before_sglang_binds_it_is_replaced_by_another(tmp_path):
    """The pick-then-bind race with a real SGLang: the first port picked is held by another socket, so the
    server, once its model is loaded, cannot bind it (uvicorn: "address already in use"); it is stopped and
    started again on a fresh port, and only that one is used."""
    from generators.backends.sglang_server import launch_sglang, listens, new_key

    path = build_tiny_model(tmp_path / "model", vllm_compatible=True)
    launch = SGLangBackendConfig().launch
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    picks = [taken]
    key = new_key()
    try:
        server = launch_sglang(
            str(sglang_python()),
            str(path),
            launch.args,
            launch.env,
            600,
            key,
            pick_port=lambda: picks.pop(0) if picks else free_port(),
        )
    finally:
        held.close()
    try:
        assert server.ports == [taken, server.port] and server.port != taken and listens(server.pid, server.port)
        assert "already in use" in server.taken[taken], server.taken
        info = httpx.get(f"{server.url}/model_info", headers={"Authorization": f"Bearer {key}"}).json()
        assert info["is_generation"]
    finally:
        server.stop()
    assert server.proc.poll() is not None
