"""The shared-prompt forward (learner/logprobs.py ``shared_prompt_hidden``): each group's prompt computed
once for its samples gives the log-probs, entropy and gradients of computing every sample whole, for
groups of different prompt and completion lengths, under temperature, top-k and top-p, and with a
completion of one token."""

import pytest
import torch

from tests.support.learner_cases import logprobs_and_grads
from learner.logprobs import SharedPrompts
from learner.tiny_model import build_tiny_model

TRANSFORMS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 5, 0.95)]


@pytest.fixture(scope="module", params=[{}, {"vllm_compatible": True}], ids=["qwen2", "llama"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=5, **request.param)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(4.0)
    return m


def _batch(seed=0):
    """Three groups, rows not in group order (as a micro-batch sorted by length is): prompts of 5, 3 and
    7 tokens, completions of 1 to 6 tokens, right-padded to the longest row."""
    g = torch.Generator().manual_seed(seed)
    spec = [(1, 3, 4), (0, 5, 6), (2, 7, 1), (0, 5, 2), (1, 3, 6), (2, 7, 3), (0, 5, 5)]  # group, prompt, completion
    prompts = {k: torch.randint(3, 13, (p,), generator=g) for k, p, _ in spec}
    L = max(p + c for _, p, c in spec)
    ids = torch.zeros(len(spec), L, dtype=torch.long)
    attn = torch.zeros_like(ids)
    positions = torch.zeros(len(spec), L - 1)
    for b, (k, p, c) in enumerate(spec):
        ids[b, :p] = prompts[k]
        ids[b, p : p + c] = torch.randint(3, 13, (c,), generator=g)
        attn[b, : p + c] = 1
        positions[b, p - 1 : p + c - 1] = 1
    shared = SharedPrompts(
        prompt_lens=torch.tensor([p for _, p, _ in spec]),
        lengths=torch.tensor([p + c for _, p, c in spec]),
        groups=torch.tensor([k for k, _, _ in spec]),
    )
    return ids, attn, positions, shared


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda t: f"T{t[0]}-k{t[1]}-p{t[2]}")
def test_shared_prompt_equals_whole_rows_values_and_gradients(model, transform):
    ids, attn, positions, shared = _batch()
    results = [logprobs_and_grads(model, ids, attn, positions, transform, shared=sh) for sh in (None, shared)]
    (whole, g_whole), (mine, g_mine) = results
    assert torch.equal(mine.outside, whole.outside)
    assert torch.allclose(mine.logp, whole.logp, atol=1e-5), (mine.logp - whole.logp).abs().max()
    assert torch.allclose(mine.entropy, whole.entropy, atol=1e-5)
    assert (mine.logp[positions == 0] == 0).all()
    assert set(g_mine) == set(g_whole) and len(g_whole) > 5
    for n in g_whole:
        assert torch.allclose(g_mine[n], g_whole[n], atol=1e-5, rtol=1e-4), (n, (g_mine[n] - g_whole[n]).abs().max())
