"""Packed micro-batches (learner/packing.py, ``learner.compute.packing``): one row without padding, positions
restarting at each sample, gives the log-probs, entropy, critic values, losses and gradients of the padded
micro-batch (fp32, 1e-5) for the model classes Relay trains, under temperature, top-k and top-p, in every
aggregation mode, with a reference KL term and with the critic; a model whose attention crosses the samples is
refused; the micro-batches hold up to the token budget with no padding. The learner's attention for packed rows,
one SDPA call per sample (``relay_packed``), gives the numbers of the masked path and of the padded rows, and is
SDPA itself for padded rows and a KV cache."""

import copy

import pytest
import torch

from learner.config import LearnerConfig
from learner.critic import ValueModel, critic_values
from learner.data import micro_batches
from learner.logprobs import token_logprobs
from learner.losses import AGGREGATIONS
import learner.packing
from learner.logprobs import check_shared_prompt
from learner.packing import check_packing, packed_micro_batches, use_packed_attention
from learner.tiny_model import build_tiny_model
from learner.update import PolicyUpdate
from tests.support.learner_cases import logprobs_and_grads, mixed_groups
from tests.unit.learner.test_kl_in_reward import PlainEngine, _model

TRANSFORMS = [(1.0, 0, 1.0), (1.5, 10, 0.99)]  # the second: 8 of 19 taken tokens outside its kept set
SAMPLING = {"temperature": 0.8, "top_k": 6, "top_p": 0.95, "n": 3}


@pytest.fixture(scope="module", params=[{}, {"vllm_compatible": True}], ids=["qwen2", "llama"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=5, **request.param)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(4.0)
    return m


class Crossing(torch.nn.Module):
    """A model whose attention ignores ``position_ids``: a packed row is one long sequence to it."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def get_input_embeddings(self):
        return self.m.get_input_embeddings()

    def forward(self, position_ids=None, **kw):
        return self.m(**kw)


def _batch(seed=0):
    """Five right-padded rows of 2 to 11 tokens (prompt + completion), one of a single completion token."""
    g = torch.Generator().manual_seed(seed)
    spec = [(3, 4), (5, 6), (7, 1), (1, 1), (4, 7)]  # prompt, completion
    L = max(p + c for p, c in spec)
    ids = torch.zeros(len(spec), L, dtype=torch.long)
    attn = torch.zeros_like(ids)
    positions = torch.zeros(len(spec), L - 1)
    for b, (p, c) in enumerate(spec):
        ids[b, : p + c] = torch.randint(3, 13, (p + c,), generator=g)
        attn[b, : p + c] = 1
        positions[b, p - 1 : p + c - 1] = 1
    return ids, attn, positions


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda t: f"T{t[0]}-k{t[1]}-p{t[2]}")
def test_packed_row_equals_padded_rows_log_probs_entropy_and_gradients(model, transform):
    ids, attn, positions = _batch()
    results = [logprobs_and_grads(model, ids, attn, positions, transform, packed=p) for p in (False, True)]
    (padded, g_padded), (mine, g_mine) = results
    assert torch.equal(mine.outside, padded.outside)
    assert torch.allclose(mine.logp, padded.logp, atol=1e-5), (mine.logp - padded.logp).abs().max()
    assert torch.allclose(mine.entropy, padded.entropy, atol=1e-5)
    assert (mine.logp[positions == 0] == 0).all() and float(mine.entropy.detach().abs().max()) > 0.1
    assert set(g_mine) == set(g_padded) and len(g_padded) > 5
    for n in g_padded:
        assert torch.allclose(g_mine[n], g_padded[n], atol=1e-5, rtol=1e-4), (n, (g_mine[n] - g_padded[n]).abs().max())


def test_per_sample_attention_equals_the_masked_path_and_the_padded_rows(model, monkeypatch):
    """relay_packed (learner/packing.py ``packed_attention``): one SDPA call per sample of the packed row, no
    mask; the same log-probs, entropy and gradients as SDPA with the block-diagonal mask and as the padded rows.
    The calls are counted: each attention layer sees the five samples' boundaries, so the test cannot pass by
    falling back to SDPA."""
    ids, attn, positions = _batch()
    transform = TRANSFORMS[1]
    padded, g_padded = logprobs_and_grads(model, ids, attn, positions, transform, packed=False)
    masked, g_masked = logprobs_and_grads(model, ids, attn, positions, transform, packed=True)
    mine = copy.deepcopy(model)
    assert use_packed_attention(mine) and mine.config._attn_implementation == "relay_packed"
    seen = []
    real = learner.packing.segment_attention

    def spy(q, k, v, bounds, scaling):
        seen.append(list(bounds))
        return real(q, k, v, bounds, scaling)

    monkeypatch.setattr(learner.packing, "segment_attention", spy)
    per_sample, g_per_sample = logprobs_and_grads(mine, ids, attn, positions, transform, packed=True)
    ends = torch.cumsum(attn.sum(-1), 0).tolist()
    assert len(seen) >= mine.config.num_hidden_layers and all(b == [0, *ends] for b in seen), seen[:2]
    for want in (masked, padded):
        assert torch.equal(per_sample.outside, want.outside)
        assert torch.allclose(per_sample.logp, want.logp, atol=1e-5), (per_sample.logp - want.logp).abs().max()
        assert torch.allclose(per_sample.entropy, want.entropy, atol=1e-5)
    for want in (g_masked, g_padded):
        assert set(g_per_sample) == set(want)
        for n in want:
            assert torch.allclose(g_per_sample[n], want[n], atol=1e-5, rtol=1e-4), n
    # padded rows (their mask) and the KV cache of the shared-prompt forward: transformers' SDPA, unchanged
    seen.clear()
    whole, g_whole = logprobs_and_grads(mine, ids, attn, positions, transform, packed=False)
    assert seen == [] and torch.allclose(whole.logp, padded.logp, atol=1e-6)
    assert all(torch.allclose(g_whole[n], g_padded[n], atol=1e-6) for n in g_padded)
    assert check_shared_prompt(mine) is None
    assert use_packed_attention(mine, on=False) and mine.config._attn_implementation == "sdpa"


def test_the_packed_row_builds_no_mask_with_per_sample_attention(model):
    """transformers builds SDPA's N × N block-diagonal mask for a packed row; with relay_packed it builds none
    (where the CPU's time went: docs/benchmarks.md learner_forwards)."""
    from transformers.masking_utils import create_causal_mask

    ids, attn, _ = _batch()
    row = ids[attn.bool()][None]
    lengths = attn.sum(-1)
    pos = (torch.arange(row.shape[1]) - (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths))[None]
    mine = copy.deepcopy(model)
    embeds = mine.get_input_embeddings()(row)
    masks = []
    for on in (False, True):
        use_packed_attention(mine, on=on)
        masks.append(create_causal_mask(mine.config, embeds, None, None, position_ids=pos))
    assert masks[0] is not None and tuple(masks[0].shape[-2:]) == (row.shape[1], row.shape[1])
    assert masks[1] is None


def test_attention_across_samples_would_change_the_numbers_and_is_refused(model):
    """The test can fail: the same row without the restarting positions (one long sequence) differs, and a
    model that drops them is refused by the start-up check."""
    ids, attn, positions = _batch()
    with torch.no_grad():
        padded = token_logprobs(model, ids, attn, positions, (1.0, 0, 1.0), 64)
        row = ids[attn.bool()][None]
        crossing = model(input_ids=row, use_cache=False).logits.log_softmax(-1)[0, :-1]
    starts = torch.cumsum(attn.sum(-1), 0) - attn.sum(-1)
    b, t = positions.bool().nonzero(as_tuple=True)
    across = crossing[starts[b] + t].gather(-1, row[0, starts[b] + t + 1, None])[:, 0]
    assert float((across - padded.logp[b, t]).abs().max()) > 1e-2
    assert check_packing(model) is None

    assert "differ" in check_packing(Crossing(model))


def test_packed_micro_batches_fill_the_budget_without_padding_and_cover_every_sample_once():
    lengths = torch.tensor([5, 40, 7, 12, 39, 6, 11, 100, 8])
    rows = torch.arange(len(lengths))
    parts = packed_micro_batches(lengths, rows, 48)
    assert sorted(torch.cat(parts).tolist()) == rows.tolist()
    for p in parts:
        assert int(lengths[p].sum()) <= 48 or len(p) == 1
    assert parts[0].tolist() == [7]  # longer than the budget: alone
    assert [p.tolist() for p in parts] == [[7], [1, 8], [4, 2], [3, 6, 5, 0]]  # 100 | 40+8 | 39+7 | 12+11+6+5
    assert len(micro_batches(lengths, rows, 48)) == 5  # padded to their longest, they need 5
    assert len(packed_micro_batches(lengths, rows, 10_000)) == 1


class RecordingEngine(PlainEngine):
    """PlainEngine that keeps the gradient of each optimizer step (and SGD steps no weight: every train step
    of a test starts from the same weights)."""

    def __init__(self, model):
        super().__init__(model)
        self.grads = []

    def forward(self, *args, **kw):
        return self.module(*args, **kw)

    def step(self):
        self.grads.append({n: p.grad.clone() for n, p in self.module.named_parameters() if p.grad is not None})
        self.opt.zero_grad()


def _critic():
    trunk = _model(2).model
    critic = ValueModel(trunk, trunk.config.hidden_size)
    torch.nn.init.normal_(critic.head.weight, std=0.5, generator=torch.Generator().manual_seed(2))
    return critic


def _step(packing: bool, per_sample: bool = False, **cfg) -> tuple[dict, list, list]:
    """One train step (two minibatches, so π_old is a forward of its own) of fresh models, micro-batches of 24
    tokens; the diagnostics and the gradients of the policy (and the critic). ``per_sample``: the policy's, the
    reference's and the critic's attention one SDPA call per packed sample (relay_packed), as the learner makes
    it with packing (learner/policy.py)."""
    estimator = cfg.pop("estimator", "grpo")
    cfg = LearnerConfig(
        compute={"micro_batch_tokens": 24, "logprob_chunk_tokens": 5, "packing": packing},
        optim={"minibatches": 2},
        loss_scale_tokens=10,
        advantages={"estimator": estimator},
        critic={"enabled": estimator == "gae"},
        regularization={"entropy_coef": 0.01, "kl_coef": 0.1},
        **cfg,
    )
    engine = RecordingEngine(_model(0))
    critic = RecordingEngine(_critic()) if estimator == "gae" else None
    reference = _model(1)
    if per_sample:
        models = [engine.module, reference] + ([critic.module.trunk] if critic else [])
        assert all(use_packed_attention(m) for m in models)
    update = PolicyUpdate(engine, cfg, pad_id=0, reference=reference, critic=critic)
    diag = update.train_step(mixed_groups(SAMPLING), SAMPLING, version=1)
    return diag, engine.grads, critic.grads if critic else []


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("estimator", ["grpo", "gae"], ids=["policy", "critic"])
def test_a_packed_step_equals_the_padded_step_in_every_aggregation_mode(aggregation, estimator):
    """Packed rows through SDPA with the block-diagonal mask, and through one SDPA call per sample (the
    learner's attention with packing), each against the padded step."""
    padded, g_padded, c_padded = _step(False, aggregation=aggregation, estimator=estimator)
    for per_sample in (False, True):
        packed, g_packed, c_packed = _step(True, per_sample, aggregation=aggregation, estimator=estimator)
        assert padded["padding_fraction"] > 0.05 and packed["padding_fraction"] == 0.0, padded["padding_fraction"]
        assert packed["micro_batches"] >= 4 and padded["micro_batches"] >= 4, (packed, padded)  # really split
        keys = ["loss", "entropy", "kl_ref", "ratio_mean", "mismatch_kl"]
        for k in keys + (["value_loss"] if estimator == "gae" else []):
            assert packed[k] == pytest.approx(padded[k], abs=1e-5, rel=1e-5), (per_sample, k)
        assert len(g_packed) == len(g_padded) == 2 and len(c_packed) == len(c_padded)
        for want, got in zip(g_padded + c_padded, g_packed + c_packed):
            assert set(got) == set(want)
            for n in want:
                assert torch.allclose(got[n], want[n], atol=1e-5, rtol=1e-4), (per_sample, n)
    assert max(float(g.abs().max()) for g in g_padded[0].values()) > 1e-3


def test_critic_values_of_a_packed_row_are_those_of_the_padded_rows():
    ids, attn, _ = _batch()
    critic = _critic()
    with torch.no_grad():
        padded, packed = critic_values(critic, ids, attn), critic_values(critic, ids, attn, packed=True)
    inside = torch.arange(ids.shape[1] - 1)[None] < (attn.sum(-1) - 1)[:, None]
    assert torch.allclose(packed[inside], padded[inside], atol=1e-5) and float(padded.abs().max()) > 0.1
    assert (packed[~inside] == 0).all()


def test_the_learner_refuses_packing_for_a_model_that_crosses_samples(model):
    from broker.runtime.config import ConfigError
    from learner.policy import _check_packing

    mine = copy.deepcopy(model)
    _check_packing(mine, LearnerConfig(compute={"packing": True}), leader=True)  # the real model: accepted
    assert mine.config._attn_implementation == "relay_packed"  # one SDPA call per packed sample
    with pytest.raises(ConfigError, match="set learner.compute.packing = false"):
        _check_packing(Crossing(model), LearnerConfig(compute={"packing": True}), leader=True)
