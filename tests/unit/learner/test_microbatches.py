"""The arithmetic that makes micro-batches exact: a batch split into pieces, each aggregated with the
whole batch's normalisers, adds up to the whole batch's loss in every aggregation mode (also split
over ranks, with DeepSpeed's averaging); micro-batches hold samples of similar length within the
token budget."""

import pytest
import torch

from learner.data import micro_batches
from learner.diagnostics import merge, summarise
from learner.losses import AGGREGATIONS, Normalisers, aggregate, policy_loss_terms
from learner.config import CorrectionConfig, PolicyLossConfig


def _data(seed=0, B=9, T=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        start = int(torch.randint(0, 3, (1,), generator=g))
        mask[b, start : start + int(torch.randint(1, T - start + 1, (1,), generator=g))] = 1
    return x, mask


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_pieces_with_the_whole_batch_normalisers_add_up_to_the_whole(mode):
    x, mask = _data()
    whole = aggregate(x, mask, mode)
    norm = Normalisers.of(mask)
    rows = [torch.tensor([0, 4]), torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7, 8])]
    # each piece padded only to its own longest sample, as micro-batches are
    pieces = [(x[r][:, :w], mask[r][:, :w]) for r in rows for w in [int(mask[r].nonzero()[:, 1].max()) + 1]]
    assert torch.allclose(sum(aggregate(xp, mp, mode, norm) for xp, mp in pieces), whole, atol=1e-12)
    # two ranks: each rank's pieces scaled by 2, DeepSpeed averages over the ranks
    two = Normalisers(norm.tokens, norm.sequences, norm.length, ranks=2)
    per_rank = [sum(aggregate(xp, mp, mode, two) for xp, mp in ps) for ps in (pieces[:2], pieces[2:])]
    assert torch.allclose(sum(per_rank) / 2, whole, atol=1e-12)
    # a piece's own normalisers would not add up (the test can fail)
    assert not torch.allclose(sum(aggregate(xp, mp, mode) for xp, mp in pieces), whole, atol=1e-6)


def test_diagnostic_sums_of_pieces_equal_those_of_the_whole():
    g = torch.Generator().manual_seed(3)
    logp = torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.3 - 1
    mu = logp + torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.7
    adv = torch.randn(6, 1, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.2).double()
    cfg = PolicyLossConfig(correction=CorrectionConfig(mode="token_mis"))
    fresh = torch.tensor([True, False, True, True, False, True])  # staleness 0
    _, whole = policy_loss_terms(logp, logp, mu, adv, mask, cfg, fresh=fresh)
    parts = [
        policy_loss_terms(logp[r], logp[r], mu[r], adv[r], mask[r], cfg, Normalisers.of(mask), fresh=fresh[r])[1]
        for r in (torch.tensor([0, 1]), torch.tensor([2, 3, 4, 5]))
    ]
    assert summarise(merge(*parts)) == pytest.approx(summarise(whole), rel=1e-12)
    assert summarise(whole)["frac_masked"] > 0 and summarise(whole)["mismatch_kl_fresh"] is not None


def test_micro_batches_keep_the_budget_group_similar_lengths_and_cover_every_sample_once():
    lengths = torch.tensor([5, 40, 7, 12, 39, 6, 11, 100, 8])
    rows = torch.arange(len(lengths))
    parts = micro_batches(lengths, rows, 48)
    assert sorted(torch.cat(parts).tolist()) == rows.tolist()
    for p in parts:
        assert len(p) * int(lengths[p].max()) <= 48 or len(p) == 1
    assert [p.tolist() for p in parts][:3] == [[7], [1], [4]]  # the longest first; 100 > 48 stands alone
    assert lengths[parts[-1]].max() <= 12  # the short ones together
    assert len(micro_batches(lengths, rows, 10_000)) == 1
