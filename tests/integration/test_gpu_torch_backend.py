"""The torch generator backend on a CUDA device: its behaviour log-probs match the learner's float32
recomputation on CPU (same sampling transform), a new version loads in place on the GPU (same module),
and, in bfloat16, the sampler/learner mismatch that the off-policy correction exists for is measured
and printed (run with -s to see it). Needs an NVIDIA GPU; skipped here otherwise."""

import json
import math

import torch

from generators.config import SamplingConfig, TorchBackendConfig
from generators.backends.torch import TorchBackend
from learner.tiny_model import build_tiny_model
from tests.support.models import needs_gpu, recompute_logprobs

pytestmark = needs_gpu()

SAMPLING = SamplingConfig(n=8, max_tokens=8, temperature=0.8, top_k=8, top_p=0.95)


def _prompts(backend, k=16):
    return [backend.encode("".join(str((i * 7 + j) % 10) for j in range(4)) + "=") for i in range(k)]


def _diffs(model, groups, prompts):
    """Per-token (behaviour - recomputed) log-prob differences, the recomputation in float32 on CPU."""
    out = []
    for p, group in zip(prompts, groups):
        for c in group:
            rec = recompute_logprobs(model, p, c.token_ids, SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p)
            out.append(torch.tensor(c.logprobs) - rec)
    return torch.cat(out)


def test_cuda_float32_logprobs_match_and_update_in_place(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    backend = TorchBackend(TorchBackendConfig(device="cuda", dtype="float32"))
    backend.load(str(path))
    engine = backend.engine_info()
    assert next(backend.model.parameters()).device.type == "cuda"
    prompts = _prompts(backend)
    d = _diffs(model, backend.generate(prompts, SAMPLING, seed=1), prompts)
    assert d.abs().max().item() <= 1e-3, d.abs().max().item()

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path / "v1", safe_serialization=True)
    (tmp_path / "v1" / "config.json").write_text((path / "config.json").read_text())
    backend.update_weights(str(tmp_path / "v1"))
    assert backend.engine_info() == engine  # same module, loaded in place
    d = _diffs(model, backend.generate(prompts, SAMPLING, seed=2), prompts)
    assert d.abs().max().item() <= 1e-3, d.abs().max().item()


def test_cuda_bfloat16_mismatch_is_measured(tmp_path):
    """bf16 sampling vs a float32 learner: a real engine mismatch, small but not zero."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    backend = TorchBackend(TorchBackendConfig(device="cuda", dtype="bfloat16"))
    backend.load(str(path))
    prompts = _prompts(backend, 64)
    d = _diffs(model, backend.generate(prompts, SAMPLING, seed=3), prompts)
    d = d[torch.isfinite(d)]
    stats = {
        "tokens": d.numel(),
        "mean_logmu_minus_logpi": d.mean().item(),
        "mean_abs": d.abs().mean().item(),
        "max_abs": d.abs().max().item(),
        "k3_kl": (torch.exp(-d) - 1 + d).mean().item(),
    }
    print("bf16 vs fp32 mismatch:", json.dumps(stats))
    assert stats["tokens"] > 0 and math.isfinite(stats["mean_abs"])
    assert 0 < stats["mean_abs"] < 0.1, stats
