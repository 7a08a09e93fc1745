"""Check then load as one read (generators/weights.py, broker/protocol/weightstore.py ``keep``): whatever
is renamed into a version's folder between the generator's check of its files and the engine's load is not
what the engine loads, for every load: a restarted generator's first version, a LoRA adapter and the base
model it pins, a version fetched over HTTP. Real redis-server, real torch backend, real Publisher (and the
learner's LoRA publication), real weight server."""

import os

import redis
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from broker.protocol import weightstore
from broker.protocol.keys import Keys
from broker.protocol.tensordigest import state_digest
from generators import weights as applier_module
from generators.config import SamplingConfig, TorchBackendConfig
from generators.weights import WeightApplier
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model


def _swap_after_check(monkeypatch, swapped: list):
    """Every check of a version folder is followed at once by what a writer of that folder can do: each
    safetensors file replaced (a rename) by one whose tensors are all moved by +1."""
    real = weightstore.check

    def check_then_swap(path, *args, **kw):
        v = real(path, *args, **kw)
        for name in v.manifest["files"]:
            if name.endswith(".safetensors"):
                f = os.path.join(path, name)
                os.chmod(path, 0o755)
                save_file({k: t + 1.0 for k, t in load_file(f).items()}, f + ".evil")
                os.replace(f + ".evil", f)
                swapped.append(f)
        return v

    monkeypatch.setattr(applier_module.weightstore, "check", check_then_swap)


def _engine_digest(backend) -> str:
    return state_digest(
        {k: v for k, v in backend.model.state_dict().items() if k != "lm_head.weight" and ".lora_" not in k}
    )


def test_a_restarted_generators_first_load_is_the_bytes_its_check_hashed(redis_url, tmp_path, monkeypatch):
    path = build_tiny_model(tmp_path / "model")
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    r, keys = redis.Redis.from_url(redis_url), Keys("ctl")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    a = Publisher(r, keys, str(tmp_path / "weights"), tok, keep_versions=4).publish(model, model.state_dict(), 3)
    swapped: list = []
    _swap_after_check(monkeypatch, swapped)
    backend = TorchBackendConfig().build()
    w = WeightApplier(r, keys, backend, "g", store=str(tmp_path / "weights"))  # a fresh start: nothing served
    w.update(block=True)
    assert swapped and w.version == 3 and not w.refused
    assert _engine_digest(backend) == a.digest  # the published weights, not the file renamed in after the check
    assert backend.generate([[1, 5, 7]], SamplingConfig(n=2, max_tokens=3), seed=0)  # built from the kept config


def test_a_lora_adapter_and_the_base_it_pins_load_the_bytes_their_check_hashed(redis_url, tmp_path, monkeypatch):
    from learner.config import LoraConfig
    from learner.lora import adapter_config, adapter_publication, apply_lora

    path = build_tiny_model(tmp_path / "model", vllm_compatible=True)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(rank=8)).eval()
    r, keys = redis.Redis.from_url(redis_url), Keys("ctl-lora")
    pub = Publisher(r, keys, str(tmp_path / "weights"), AutoTokenizer.from_pretrained(path), keep_versions=3)
    pub.adapter_config = adapter_config(model)
    for v in range(3):  # version 0: the base and its adapter; 1, 2: adapters alone, pinned to it
        g = torch.Generator().manual_seed(v)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        a = pub.publish(model, adapter_publication(model.state_dict(), pub.needs_base), v)
    assert a.adapter_only
    swapped: list = []
    _swap_after_check(monkeypatch, swapped)
    backend = TorchBackendConfig().build()
    w = WeightApplier(r, keys, backend, "g", store=str(tmp_path / "weights"))
    w.update(block=True)  # the base from version 0, then the adapter of version 2
    assert w.version == 2 and not w.refused and len(swapped) >= 3  # the base's file, both adapters' files
    served = {k: t for k, t in backend.model.state_dict().items() if ".lora_" in k}
    learner = {k.removeprefix("base_model.model."): t for k, t in model.state_dict().items()}  # peft's wrapper
    assert served and set(served) <= set(learner)
    assert all(torch.equal(served[k], learner[k]) for k in served), "the adapter loaded is not the one published"
    base = {k: t for k, t in backend.model.state_dict().items() if ".lora_" not in k and k in learner}
    assert base and all(torch.equal(t, learner[k]) for k, t in base.items()), "the base loaded is not the published"


def test_a_version_fetched_over_http_loads_the_bytes_the_fetcher_hashed(redis_url, tmp_path):
    from broker.protocol.weights_config import HttpTransport
    from generators.weight_fetch import WeightFetcher
    from learner.weight_server import WeightServer

    path = build_tiny_model(tmp_path / "model")
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    r, keys = redis.Redis.from_url(redis_url), Keys("ctl-http")
    server = WeightServer(tmp_path / "weights").start()
    try:
        pub = Publisher(r, keys, str(tmp_path / "weights"), tok, keep_versions=4)
        pub.url_for = server.url
        a = pub.publish(model, model.state_dict(), 0)
        fetcher = WeightFetcher(HttpTransport(cache_dir=str(tmp_path / "cache"), advertise_url=server.base_url))
        backend = TorchBackendConfig().build()
        real_load, swapped = backend.load, []

        def swap_then_load(folder, *args, **kw):  # someone who can write the cache, between the fetch and the load
            f = os.path.join(folder, "model.safetensors")
            save_file({k: t + 1.0 for k, t in load_file(f).items()}, f + ".evil")
            os.replace(f + ".evil", f)
            swapped.append(f)
            return real_load(folder, *args, **kw)

        backend.load = swap_then_load
        w = WeightApplier(r, keys, backend, "g", fetcher=fetcher)
        w.update(block=True)
    finally:
        server.close()
    assert swapped and w.version == 0 and _engine_digest(backend) == a.digest
