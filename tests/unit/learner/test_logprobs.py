"""Chunked log-probs and entropy (learner/logprobs.py) equal those of the full logits through the
sampling transform (broker/protocol/sampling.py), values and gradients, with temperature, top-k and
top-p; tokens outside the kept set are flagged, never NaN."""

import pytest
import torch

from broker.protocol.sampling import sampling_logprobs
from learner.logprobs import check_output_head, token_logprobs
from learner.tiny_model import build_tiny_model

TRANSFORMS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 5, 1.0), (1.3, 0, 0.9), (0.8, 8, 0.95)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # sharper logits than the random init, so top-p keeps few tokens
        m.get_output_embeddings().weight.mul_(8.0)
    return m


def _batch(seed=0, B=4, L=11):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 13, (B, L), generator=g)
    attn = torch.ones(B, L, dtype=torch.long)
    positions = torch.zeros(B, L - 1)
    for b, n in enumerate([11, 7, 9, 4][:B]):
        attn[b, n:] = 0
        ids[b, n:] = 0
        positions[b, 2 : n - 1] = 1  # the completion: from the third token on
    return ids, attn, positions


def _unchunked(model, ids, attn, positions, transform):
    """The learner's recomputation before chunking: the full logits through the transform."""
    all_logp = sampling_logprobs(model(input_ids=ids, attention_mask=attn).logits[:, :-1], *transform)
    logp = all_logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    p = all_logp.exp()
    ent = -(p * all_logp.masked_fill(p == 0, 0.0)).sum(-1)  # 0 log 0 = 0 (also in the gradient)
    return logp, ent


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda t: f"T{t[0]}-k{t[1]}-p{t[2]}")
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_equal_unchunked_values(model, transform, chunk):
    ids, attn, positions = _batch()
    with torch.no_grad():
        want_logp, want_ent = _unchunked(model, ids, attn, positions, transform)
        got = token_logprobs(model, ids, attn, positions, transform, chunk, entropy=True)
    m = positions.bool()
    assert torch.equal(got.outside, torch.isinf(want_logp) & m)
    inside = m & ~got.outside
    assert torch.allclose(got.logp[inside], want_logp[inside], atol=1e-5)
    assert torch.allclose(got.entropy[m], want_ent[m], atol=1e-5)
    assert (got.logp[~m] == 0).all() and (got.entropy[~m] == 0).all() and (got.logp[got.outside] == 0).all()


@pytest.mark.parametrize("transform", [(1.0, 0, 1.0), (0.8, 8, 0.95)], ids=["plain", "topk-topp"])
def test_chunked_equal_unchunked_gradients(model, transform):
    ids, attn, positions = _batch(1)
    weights = torch.randn(positions.shape, generator=torch.Generator().manual_seed(2))

    def grads(fn):
        model.zero_grad()
        logp, ent = fn()
        ((logp * weights).sum() + ent.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want_logp, _ = _unchunked(model, ids, attn, positions, transform)
    keep = positions.bool() & ~torch.isinf(want_logp.detach())  # the loss leaves out-of-set tokens out

    def full():
        logp, ent = _unchunked(model, ids, attn, positions, transform)
        return torch.where(keep, logp, 0.0), torch.where(positions.bool(), ent, 0.0)

    def chunked():
        got = token_logprobs(model, ids, attn, positions, transform, 3, entropy=True)
        return got.logp, got.entropy

    want, got = grads(full), grads(chunked)
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        assert torch.allclose(got[name], want[name], atol=1e-5), name


def test_a_token_outside_the_kept_set_is_flagged_with_a_finite_log_prob_and_gradient(model):
    ids, attn, positions = _batch(2)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    worst = logits.argmin(-1)  # the least likely token: outside any top-k
    ids = ids.clone()
    ids[:, 1:] = torch.where(positions.bool(), worst, ids[:, 1:])
    got = token_logprobs(model, ids, attn, positions, (1.0, 3, 1.0), 4, entropy=True)
    assert got.outside[positions.bool()].any()
    model.zero_grad()
    (got.logp.sum() + got.entropy.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_model_whose_logits_are_not_its_head_is_refused(model):
    check_output_head(model)  # the tiny Qwen2: its logits are lm_head(last hidden state)

    class Capped(torch.nn.Module):  # a final soft-cap applied after the head
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kw):
            out = self.inner(**kw)
            if out.logits.shape[1]:
                out.logits = 30 * torch.tanh(out.logits / 30)
            return out

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

    with pytest.raises(ValueError, match="not lm_head"):
        check_output_head(Capped(model))


@pytest.mark.parametrize("transform", [(1.0, 5, 1.0), (1.0, 0, 0.9), (0.8, 20, 0.7), (1.0, 0, 1.0)])
def test_the_kept_set_stored_compactly_is_the_transform_s_even_with_ties(transform):
    from learner.logprobs import _kept_set, _rebuild

    g = torch.Generator().manual_seed(5)
    z = (torch.randn(64, 200, generator=g) * 2).to(torch.bfloat16).float()  # bf16 logits: many ties
    z[0, :10] = 3.0  # ties straddling the top-k and top-p boundaries
    z[1] = 0.0  # a flat row: every token tied
    want = sampling_logprobs(z, 1.0, *transform[1:])
    logp_all, compact = _kept_set(z, transform)
    assert torch.equal(logp_all, want)
    if compact is None:  # nothing cut
        assert torch.isfinite(want).all()
        return
    assert torch.equal(_rebuild(z, compact), torch.isfinite(want))
    assert all(len(tied) < 20 for i, tied in compact[2].items() if i != 1)  # a few tied indices, not whole rows
