"""The torch backend's group prefill: each prompt is computed once and its KV cache copied to the
n samples of its group. The samples must be exactly those of n separate copies of the prompt."""

import pytest
import torch

from generators.backends.torch import TorchBackend
from generators.config import SamplingConfig, TorchBackendConfig


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from learner.tiny_model import build_tiny_model

    d = tmp_path_factory.mktemp("tiny")
    build_tiny_model(d, seed=0)
    b = TorchBackend(TorchBackendConfig())
    b.load(str(d))
    return b


def test_a_group_shares_its_prompts_prefill_and_samples_as_if_each_row_had_its_own(backend):
    prompts = [backend.encode("473="), backend.encode("12+7=")]  # different lengths: left padding differs too
    sampling = SamplingConfig(n=3, temperature=1.0, top_k=5, max_tokens=6)
    grouped = backend.generate(prompts, sampling, seed=7)
    rows = backend.generate([p for p in prompts for _ in range(3)], sampling.model_copy(update={"n": 1}), seed=7)
    assert [len(g) for g in grouped] == [3, 3]
    flat = [c for g in grouped for c in g]
    for a, (b,) in zip(flat, rows):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert len({tuple(c.token_ids) for c in grouped[0]}) > 1, "the samples of a group must differ"
