"""A packed row's sample bounds are read from its positions once per forward (learner/packing.py ``Packed.bounds``,
one ``.tolist()``: a host sync on a GPU) and handed to every attention layer as the keyword ``relay_segments``,
not read again by each layer: for the learner's per-sample attention (``relay_packed``), for the Ulysses attention
without a shard (``relay_ulysses`` on one rank), for the critic's trunk, and for the layers recomputed by
activation checkpointing in the backward. The calls of ``segments`` are counted on a model of 3 layers; the
same model called without the keyword reads them in every layer (the count can fail)."""

import copy

import pytest
import torch

import learner.packing
from learner import sequence_parallel
from learner.critic import ValueModel, critic_values
from learner.logprobs import token_logprobs
from learner.packing import packed_hidden, use_packed_attention
from learner.tiny_model import build_tiny_model

LAYERS = 3


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=2, layers=LAYERS)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _batch():
    """Four right-padded rows of 2 to 9 tokens; every completion position trained on."""
    lens = [9, 4, 2, 6]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 13, (len(lens), max(lens)), generator=g)
    attn = (torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]).long()
    positions = attn[:, 1:].float()
    return ids * attn, attn, positions, lens


def _counted(monkeypatch):
    """Calls of learner.packing.segments (the only place that reads the bounds off the positions) and of
    segment_attention (one per attention layer run, recomputed ones included), with the bounds each got."""
    calls = {"segments": 0, "attention": []}
    real_segments, real_attention = learner.packing.segments, learner.packing.segment_attention

    def segments(position_ids):
        calls["segments"] += 1
        return real_segments(position_ids)

    def attention(q, k, v, bounds, scaling):
        calls["attention"].append(list(bounds))
        return real_attention(q, k, v, bounds, scaling)

    monkeypatch.setattr(learner.packing, "segments", segments)
    monkeypatch.setattr(learner.packing, "segment_attention", attention)
    monkeypatch.setattr(sequence_parallel, "segment_attention", attention)
    return calls


def _model(base, attention: str, checkpointing: bool):
    m = copy.deepcopy(base)
    if attention == "relay_packed":
        assert use_packed_attention(m)
    else:
        sequence_parallel.enable(m)
    if checkpointing:
        m.config.use_cache = False
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    assert m.config._attn_implementation == attention and m.config.num_hidden_layers == LAYERS
    return m


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("attention", ["relay_packed", "relay_ulysses"])
def test_the_bounds_are_read_once_per_forward_and_reach_every_layer(base, monkeypatch, attention, checkpointing):
    ids, attn, positions, lens = _batch()
    m = _model(base, attention, checkpointing)
    calls = _counted(monkeypatch)
    lp = token_logprobs(m, ids, attn, positions, (1.0, 0, 1.0), 8, entropy=True, packed=True)
    want = [0, *torch.cumsum(torch.tensor(lens), 0).tolist()]
    assert calls["segments"] == 1 and calls["attention"] == [want] * LAYERS
    (-(lp.logp * positions).sum() - 0.1 * lp.entropy.sum()).backward()
    # the backward recomputes each layer with checkpointing (the same bounds, no new read), none without
    assert calls["segments"] == 1
    assert calls["attention"] == [want] * (2 * LAYERS if checkpointing else LAYERS)
    assert any(p.grad is not None and float(p.grad.abs().max()) > 0 for p in m.parameters())

    # the same numbers as the bounds read by each layer from the positions (the forward without the keyword)
    where = positions.bool().nonzero(as_tuple=True)
    with torch.no_grad():
        once = packed_hidden(m, ids, attn, where)
        calls["segments"] = 0
        p = learner.packing.Packed.of(ids, attn)
        out = m(input_ids=p.input_ids, position_ids=p.position_ids, output_hidden_states=True, use_cache=False)
        per_layer = out.hidden_states[-1][0, p.columns(*where)]
    assert calls["segments"] == LAYERS  # without the keyword: every layer reads them (what the keyword saves)
    assert torch.equal(once, per_layer)


def test_the_critic_trunk_reads_the_bounds_once_per_forward(base, monkeypatch):
    ids, attn, _, lens = _batch()
    m = _model(base, "relay_packed", checkpointing=False)
    critic = ValueModel(m.base_model, m.config.hidden_size)
    torch.nn.init.normal_(critic.head.weight, generator=torch.Generator().manual_seed(1))
    calls = _counted(monkeypatch)
    packed = critic_values(critic, ids, attn, packed=True)
    assert calls["segments"] == 1 and len(calls["attention"]) == LAYERS
    padded = critic_values(critic, ids, attn)
    mask = attn[:, 1:].bool()
    assert torch.allclose(packed[mask], padded[mask], atol=1e-5) and float(padded[mask].detach().abs().max()) > 0


def test_bounds_that_do_not_cover_the_row_are_refused(base):
    ids, attn, _, _ = _batch()
    m = _model(base, "relay_packed", checkpointing=False)
    p = learner.packing.Packed.of(ids, attn)
    with pytest.raises(ValueError, match="do not cover the row"):
        m(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False, relay_segments=[0, 5, 9])
