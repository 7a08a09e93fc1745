"""The sglang backend's error paths, against tests/support/sglang_mock_server.py (SGLang's HTTP shapes around a
real model): answers a real SGLang server gives only when something else goes wrong. What the backend does with
a real SGLang server is tests/integration/test_sglang_server.py (make test-sglang)."""

import sys
from pathlib import Path

import httpx
import pytest
import redis

from broker.protocol import weightstore
from broker.protocol.keys import Keys
from deploy.launcher.procs import free_port
from generators.backends.sglang import SGLangError
from generators.config import GeneratorConfig, SamplingConfig, SGLangBackendConfig
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.support.services import ROOT, announce_key, child_env, wait_http


def start_mock(procs, path, tmp_path, *flags):
    port = free_port()
    argv = [sys.executable, str(ROOT / "tests" / "support" / "sglang_mock_server.py"), "--model", str(path)]
    child = procs.start("sglang", [*argv, "--port", str(port), *flags], env=child_env(), cwd=str(ROOT))
    wait_http(f"http://127.0.0.1:{port}/get_model_info", child, timeout=120)
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def versions(redis_url, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path)
    pub = Publisher(
        redis.Redis.from_url(redis_url),
        Keys("t"),
        str(tmp_path / "weights"),
        AutoTokenizer.from_pretrained(path),
        keep_versions=10,
        announce_key=announce_key(tmp_path),
    )
    return path, pub.publish(model, model.state_dict(), 0)


@pytest.mark.slow  # a server process of its own: left to `make test`
def test_a_version_changed_by_another_client_is_refused(procs, tmp_path, versions):
    path, a0 = versions
    url = start_mock(procs, path, tmp_path)
    backend = SGLangBackendConfig(url=url).build()
    backend.load(a0.path)
    assert backend.engine_info()["weight_version"] == "0"
    (g,) = backend.generate([[1, 4, 5, 14]], SamplingConfig(n=2, max_tokens=4), seed=0)
    assert len(g) == 2
    httpx.post(f"{url}/update_weight_version", json={"new_version": "7"}).raise_for_status()
    with pytest.raises(SGLangError, match="served weight version 7, expected 0"):
        backend.generate([[1, 4, 5, 14]], SamplingConfig(n=2, max_tokens=4), seed=0)


@pytest.mark.slow  # a server process of its own: left to `make test`
def test_a_refused_folder_leaves_the_old_version_serving(procs, tmp_path, versions):
    path, a0 = versions
    backend = SGLangBackendConfig(url=start_mock(procs, path, tmp_path)).build()
    backend.load(a0.path)
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / weightstore.MANIFEST).write_text((Path(a0.path) / weightstore.MANIFEST).read_text())
    with pytest.raises(SGLangError, match="answered 400"):
        backend.update_weights(str(bad))
    assert backend.engine_info()["weight_version"] == "0"


@pytest.mark.slow  # a server process of its own: left to `make test`
def test_a_server_whose_model_does_not_generate_is_refused(procs, tmp_path, versions):
    path, a0 = versions
    backend = SGLangBackendConfig(url=start_mock(procs, path, tmp_path, "--embedding")).build()
    with pytest.raises(SGLangError, match="does not generate"):
        backend.load(a0.path)


def test_top_k_or_top_p_and_continue_are_accepted_top_k_with_top_p_is_not():
    for sampling in ({"top_k": 5}, {"top_p": 0.9}, {"top_k": 1, "top_p": 0.9}):
        cfg = GeneratorConfig(backend={"type": "sglang"}, sampling=sampling, in_flight="continue")
        assert cfg.backend.supports_in_flight
    with pytest.raises(ValueError, match="top_k or top_p, not both"):
        GeneratorConfig(backend={"type": "sglang"}, sampling={"top_k": 5, "top_p": 0.9})


def test_a_top_k_generator_launches_its_server_with_masks_of_top_k_ids_top_p_with_the_vocabulary():
    launch = {"python": "/sglang/bin/python"}
    top_k = GeneratorConfig(backend={"type": "sglang", "launch": launch}, sampling={"top_k": 5})
    assert top_k.backend.launch.sampling_mask_max_tokens == 5
    top_p = GeneratorConfig(backend={"type": "sglang", "launch": launch}, sampling={"top_p": 0.9})
    assert top_p.backend.launch.sampling_mask_max_tokens == 0  # the vocabulary's size, read from the model at load
    mine = GeneratorConfig(
        backend={"type": "sglang", "launch": {**launch, "sampling_mask_max_tokens": 64}}, sampling={"top_k": 5}
    )
    assert mine.backend.launch.sampling_mask_max_tokens == 64
    with pytest.raises(ValueError, match="sampling_mask_max_tokens = 4 is below generator.sampling.top_k = 5"):
        GeneratorConfig(
            backend={"type": "sglang", "launch": {**launch, "sampling_mask_max_tokens": 4}}, sampling={"top_k": 5}
        )
