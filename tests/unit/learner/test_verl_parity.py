"""Relay's estimators, aggregation modes, KL estimators and corrections against verl's formulas
(verl ``verl/trainer/ppo/core_algos.py`` and ``rollout_corr_helper.py``, main of early 2026), each
written out here independently, on random inputs with groups of one, fully masked rows and ratios
past the dual-clip bound, to 1e-6. Where Relay differs on purpose (a group of one; rejected tokens
in the token-mean denominator) the test pins Relay's choice (docs/off-policy.md says why)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from broker.protocol.group import Sample
from learner.advantages import batch_advantages
from learner.config import CorrectionConfig, LearnerConfig, PolicyLossConfig
from learner.correction import importance_weights
from learner.data import collate
from learner.losses import AGGREGATIONS, aggregate, compute_policy_loss, kl_estimate, ppo_loss_mat
from learner.update import PolicyUpdate
from tests.support.data import make_group
from tests.unit.learner.test_algorithms import float64  # noqa: F401 (autouse: exact comparisons in float64)


def _groups_of(sizes, seed=0):
    """Rewards per group (sizes may be 1), with ties broken at random."""
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(n, generator=g) for n in sizes]


def _masks(tokens: torch.Tensor, T: int) -> torch.Tensor:
    return (torch.arange(T)[None, :] < tokens[:, None]).double()


# ----------------------------------------------------------------------------------------------
# verl's formulas, written out


def verl_group_outcome(scores, index, kind, eps=1e-6):
    """verl compute_grpo_outcome_advantage (kind grpo / drgrpo: norm_adv_by_std_in_grpo False) and
    compute_rloo_outcome_advantage: a group of one has mean 0 (and std 1)."""
    out = []
    for i, s in enumerate(scores.tolist()):
        grp = [scores[j].item() for j in range(len(scores)) if index[j] == index[i]]
        n = len(grp)
        mean = sum(grp) / n if n > 1 else 0.0
        std = (sum((x - mean) ** 2 for x in grp) / (n - 1)) ** 0.5 if n > 1 else 1.0
        if kind == "grpo":
            out.append((s - mean) / (std + eps))
        elif kind == "drgrpo":
            out.append(s - mean)
        else:  # rloo
            out.append(s * n / (n - 1) - mean * n / (n - 1) if n > 1 else s)
    return torch.tensor(out)


def verl_masked_whiten(values, mask):
    """verl verl_F.masked_whiten: masked_mean (Σ / (Σ mask + 1e-8)), unbiased masked_var, rsqrt(var + 1e-8)."""
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = (((values - mean) ** 2) * mask).sum() / (mask.sum() + 1e-8)
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_reinforce_pp(token_level_rewards, mask, gamma=1.0):
    """verl compute_reinforce_plus_plus_outcome_advantage: discounted returns reset after EOS, whitened."""
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros(token_level_rewards.shape[0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return verl_masked_whiten(returns, mask) * mask


def verl_reinforce_pp_baseline(token_level_rewards, mask, index):
    """verl compute_reinforce_plus_plus_baseline_outcome_advantage: score − group mean (0 for a group of
    one), tiled over the response, whitened."""
    scores = token_level_rewards.sum(-1)
    centred = scores.clone()
    for i in range(len(scores)):
        grp = scores[index == index[i]]
        centred[i] = scores[i] - (grp.mean() if len(grp) > 1 else 0.0)
    return verl_masked_whiten(centred[:, None] * mask, mask) * mask


def verl_agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None):
    """verl agg_loss (after verl PR #5417): the seq-mean modes leave out fully masked sequences;
    seq-mean-token-sum-norm is seq-mean-token-sum divided by the horizon (loss_mask.shape[-1])."""
    seq_sum = (loss_mat * loss_mask).sum(-1)
    seq_tokens = loss_mask.sum(-1)
    seq_mask = (seq_tokens > 0).double()
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if mode == "seq-mean-token-sum":
        return (seq_sum * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-mean":
        return (seq_sum / (seq_tokens + 1e-8) * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-sum-norm":
        T = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return (seq_sum * seq_mask).sum() / seq_mask.sum() / T
    raise AssertionError(mode)


def verl_kl_penalty_forward(logprob, ref_logprob, kind):
    """verl kl_penalty_forward: kl/k1, abs, mse/k2, low_var_kl/k3 (log-ratio clamped to ±20, value to ±10)."""
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind == "k2":
        return 0.5 * (logprob - ref_logprob) ** 2
    kl = (ref_logprob - logprob).clamp(-20, 20)
    return (torch.exp(kl) - kl - 1).clamp(-10, 10)


# ----------------------------------------------------------------------------------------------
# advantages


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_group_estimators_match_verl_and_a_group_of_one_gets_zero(kind):
    """verl compute_grpo_outcome_advantage / compute_rloo_outcome_advantage, groups of 1..6."""
    rewards = _groups_of([4, 1, 6, 2, 1, 3], seed=1)
    got = batch_advantages(kind, rewards, [torch.ones(len(r)) for r in rewards])
    index = torch.repeat_interleave(torch.arange(len(rewards)), torch.tensor([len(r) for r in rewards]))
    want = verl_group_outcome(torch.cat(rewards), index, kind).split([len(r) for r in rewards])
    for r, a, w in zip(rewards, got, want):
        if len(r) > 1:
            assert torch.allclose(a.double(), w, atol=1e-6)
        else:  # Relay's deliberate choice: no baseline, no signal; verl trains on the raw score
            assert a.tolist() == [0.0] and abs(w.item() - r.item()) < 1e-5


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_matches_verl_over_the_batch_tokens(baseline):
    """verl compute_reinforce_plus_plus_outcome_advantage (γ = 1) and
    compute_reinforce_plus_plus_baseline_outcome_advantage: the outcome reward on the last token,
    whitened over every token of the batch; a zero-length completion (fully masked row) included."""
    sizes = [3, 4, 2, 5]
    rewards = _groups_of(sizes, seed=2)
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(1, 9, (n,), generator=g) for n in sizes]
    tokens[2][1] = 0  # an empty completion: no token, its reward 0 so verl (which has no token to put it on) agrees
    rewards[2][1] = 0.0
    flat_r, flat_n = torch.cat(rewards), torch.cat(tokens)
    index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    mask = _masks(flat_n, 9)
    token_rewards = torch.zeros_like(mask)
    for i, n in enumerate(flat_n.tolist()):
        if n:
            token_rewards[i, n - 1] = flat_r[i]  # the outcome reward on the last token
    want = (
        verl_reinforce_pp_baseline(token_rewards, mask, index) if baseline else verl_reinforce_pp(token_rewards, mask)
    )
    got = torch.cat(batch_advantages("reinforce_pp_baseline" if baseline else "reinforce_pp", rewards, tokens))
    assert torch.allclose(got[:, None] * mask, want, atol=1e-6)
    assert float(got[mask.sum(-1) > 0].abs().max()) > 0.5  # real advantages, not zeros


def test_reinforce_pp_baseline_centres_a_group_of_one_to_zero():
    """verl compute_reinforce_plus_plus_baseline_outcome_advantage keeps a lone sample's raw score
    (mean 0); Relay centres it to 0 like the group estimators, then whitens with the batch."""
    rewards = _groups_of([3, 1, 4], seed=4)
    tokens = [torch.full((len(r),), 5) for r in rewards]
    index = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    mask = _masks(torch.cat(tokens), 5)
    token_rewards = torch.zeros_like(mask)
    token_rewards[:, 4] = torch.cat(rewards)
    token_rewards[3, 4] = 0.0  # verl's formula with the lone sample's centred score, 0, in place of its raw score
    want = verl_reinforce_pp_baseline(token_rewards, mask, index)
    got = torch.cat(batch_advantages("reinforce_pp_baseline", rewards, tokens))
    assert torch.allclose(got[:, None] * mask, want, atol=1e-6)
    token_rewards[3, 4] = rewards[1].item()
    assert not torch.allclose(got[:, None] * mask, verl_reinforce_pp_baseline(token_rewards, mask, index), atol=1e-3)


def test_the_learner_applies_the_configured_batch_estimator():
    """PolicyUpdate.advantages (what train_step collates): REINFORCE++ over the whole batch, samples
    whose reward failed left out (verl compute_reinforce_plus_plus_outcome_advantage)."""

    def sample(t, reward, status="ok"):
        return Sample(
            np.arange(3, 3 + t, dtype=np.int32), np.full(t, -0.5, np.float32), [[0, t]], "stop", reward, status
        )

    groups = [
        make_group(samples=[sample(2, 1.0), sample(4, 0.0), sample(3, None, "failed")]),
        make_group(samples=[sample(5, 0.5), sample(1, 0.25)]),
    ]
    update = PolicyUpdate(
        SimpleNamespace(device="cpu"), LearnerConfig(advantages={"estimator": "reinforce_pp"}), pad_id=0
    )
    got = update.advantages(groups)
    assert [len(a) for a in got] == [2, 2]
    n, r = torch.tensor([2, 4, 5, 1]), torch.tensor([1.0, 0.0, 0.5, 0.25])
    mask = _masks(n, 5)
    want = verl_reinforce_pp(torch.zeros_like(mask).scatter(1, (n - 1)[:, None], r[:, None]), mask)
    assert torch.allclose(torch.cat(got).double()[:, None] * mask, want, atol=1e-6)
    b = collate(groups, got, 0, 0)
    assert torch.equal(b.advantages[:, 0], torch.cat(got).to(b.advantages.dtype))


def test_estimators_that_need_a_critic_are_refused_naming_it():
    for name in ("gae", "vtrace"):
        with pytest.raises(ValueError, match="needs a critic"):
            LearnerConfig(advantages={"estimator": name})
    assert (
        LearnerConfig(advantages={"estimator": "reinforce_pp_baseline"}).advantages.estimator == "reinforce_pp_baseline"
    )
    with_critic = LearnerConfig(advantages={"estimator": "gae"}, critic={"enabled": True})
    assert with_critic.critic.lr == with_critic.optim.lr == 5e-4  # the tiny model's per-token default (docs/learner.md)
    assert with_critic.critic.deepspeed == with_critic.deepspeed  # the policy's engine settings by default


# ----------------------------------------------------------------------------------------------
# aggregation


def _loss_and_mask(seed=5, B=7, T=9):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g)
    mask = _masks(torch.randint(1, T + 1, (B,), generator=g), T)
    mask[2] = 0  # a zero-length completion
    mask[5] = 0
    return x, mask


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation_matches_verl_agg_loss_with_fully_masked_rows(mode):
    """verl agg_loss: fully masked rows are left out of the seq-mean denominators, and
    seq-mean-token-sum-norm divides by the sequences × the horizon (not by the horizon alone)."""
    x, mask = _loss_and_mask()
    assert torch.allclose(aggregate(x, mask, mode), verl_agg_loss(x, mask, mode), atol=1e-6)


def test_seq_mean_token_sum_norm_does_not_grow_with_the_batch():
    x, mask = _loss_and_mask()
    one = aggregate(x, mask, "seq-mean-token-sum-norm")
    four = aggregate(x.repeat(4, 1), mask.repeat(4, 1), "seq-mean-token-sum-norm")
    assert torch.allclose(one, four, atol=1e-12)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_rejected_sequences_leave_the_seq_mean_denominators(mode):
    """verl's sequence rejection (rollout_corr_helper, seq_*_k1 options) zeroes the response mask of a
    rejected sequence, so agg_loss's seq-mean modes count only those left; Relay's seq_mis does the
    same. Token-mean is the deliberate difference: a rejected token stays in Relay's denominator."""
    g = torch.Generator().manual_seed(6)
    B, T = 6, 5
    mask = _masks(torch.tensor([5, 3, 4, 0, 2, 5]), T)
    logp = torch.randn(B, T, generator=g) * 0.2 - 1
    mu = logp.clone()
    mu[1] -= 1.0  # ρ = e per token: the sequence ratio e³ > hi -> rejected
    mu[4] += 1.5  # rejected below lo
    a = torch.randn(B, 1, generator=g)
    cfg = PolicyLossConfig(aggregation=mode, correction=CorrectionConfig(mode="seq_mis", mask_lo=0.2, mask_hi=5.0))
    loss, _ = compute_policy_loss(logp, logp.detach(), mu, a, mask, cfg)
    kept = mask.clone()
    kept[1] = kept[4] = 0
    ell = -a * torch.ones_like(logp)  # on-policy: r = 1, ℓ = −A
    want = verl_agg_loss(ell, mask if mode == "token-mean" else kept, mode)
    if mode == "token-mean":
        want = (ell * kept).sum() / mask.sum()
    assert torch.allclose(loss, want, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# KL estimators


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_kl_estimators_match_verl_kl_penalty_forward(kind):
    """verl kl_penalty_forward, with differences up to ±25 nats (k3's clamps reached)."""
    g = torch.Generator().manual_seed(7)
    logp = torch.randn(4, 50, generator=g) * 8 - 3
    ref = torch.randn(4, 50, generator=g) * 8 - 3
    got, want = kl_estimate(logp, ref, kind), verl_kl_penalty_forward(logp, ref, kind)
    assert torch.allclose(got, want, atol=1e-6)
    if kind == "k3":
        assert float(got.max()) == 10.0 and float(got.min()) >= 0.0


# ----------------------------------------------------------------------------------------------
# policy loss: dual-clip, IcePop and token rejection


def test_dual_clip_binds_where_ratios_pass_its_bound():
    """verl compute_policy_loss_vanilla with clip_ratio_c = 3: for A < 0, min(−A c, max(−A r, −A clip(r)))."""
    g = torch.Generator().manual_seed(8)
    old = torch.randn(6, 8, generator=g) * 0.2 - 1
    logp = old + torch.randn(6, 8, generator=g) * 1.5  # ratios from ~0.01 to ~100
    a = torch.randn(6, 8, generator=g)
    r = torch.exp(logp - old)
    clip1 = torch.maximum(-a * r, -a * r.clamp(0.8, 1.28))
    want = torch.where(a < 0, torch.minimum(-a * 3.0, clip1), clip1)
    got, clipped = ppo_loss_mat(logp, old, a, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert torch.allclose(got, want, atol=1e-6)
    bound = (a < 0) & (r > 3.0)
    assert int(bound.sum()) >= 3  # the dual-clip really binds somewhere
    assert torch.allclose(got[bound], (-a * 3.0)[bound]) and bool((clipped[bound] == 1).all())
    without, _ = ppo_loss_mat(logp, old, a, clip_low=0.2, clip_high=0.28)
    assert bool((without[bound] > got[bound]).all())


def test_icepop_weights_in_band_tokens_and_keeps_the_rest_in_the_denominator():
    """Token-level IcePop (verl): w = ρ for lo ≤ ρ ≤ hi, else 0, the response mask unchanged, so
    out-of-band tokens stay in the token-mean denominator. token_mis is verl's two-sided token
    rejection (rollout_rs token_k1): out-of-band tokens leave the mask, w = 1."""
    g = torch.Generator().manual_seed(9)
    B, T = 5, 6
    mask = _masks(torch.tensor([6, 4, 0, 5, 2]), T)
    logp = torch.randn(B, T, generator=g) * 0.3 - 1
    mu = logp + torch.randn(B, T, generator=g) * 1.2
    a = torch.randn(B, 1, generator=g)
    rho = torch.exp(logp - mu)
    band = ((rho >= 0.5) & (rho <= 2.0)).double() * mask
    assert 0 < band.sum() < mask.sum()
    cfg = PolicyLossConfig(correction=CorrectionConfig(mode="icepop", mask_lo=0.5, mask_hi=2.0))
    loss, _ = compute_policy_loss(logp, logp.detach(), mu, a, mask, cfg)
    ell = -a * torch.ones_like(logp)
    assert torch.allclose(loss, verl_agg_loss(ell * rho * band, mask, "token-mean"), atol=1e-6)
    w, keep = importance_weights(logp, mu, mask, cfg.correction)
    assert torch.equal(keep, mask) and torch.allclose(w * mask, rho * band, atol=1e-12)
    cfg = PolicyLossConfig(correction=CorrectionConfig(mode="token_mis", mask_lo=0.5, mask_hi=2.0))
    _, keep = importance_weights(logp, mu, mask, cfg.correction)
    assert torch.equal(keep, band)


def test_the_learner_counts_the_sequences_left_after_rejection_before_its_micro_batches():
    """PolicyUpdate's seq-mean denominator for the (mini)batch, from π_old computed up front: the
    samples with a kept token (verl agg_loss's seq_mask on the rejected response mask)."""

    def sample(t, mu):
        return Sample(np.arange(3, 3 + t, dtype=np.int32), np.full(t, mu, np.float32), [[0, t]], "stop", 1.0)

    groups = [make_group(samples=[sample(3, -1.0), sample(2, -4.0)]), make_group(samples=[sample(4, -1.0)])]
    cfg = LearnerConfig(aggregation="seq-mean-token-mean", correction=CorrectionConfig(mode="seq_mis"))
    update = PolicyUpdate(SimpleNamespace(device="cpu"), cfg, pad_id=0)
    assert "seq_mis" in update.old_up_front  # π_old computed up front, to count the rejected sequences
    b = collate(groups, [torch.zeros(2), torch.zeros(1)], 0, 0)
    old = (torch.full_like(b.behaviour_logp, -1.0), torch.zeros_like(b.loss_mask, dtype=torch.bool))
    # sample 1: ρ = e³ per token, e⁶ over its 2 tokens > mask_hi = 5: rejected
    assert update._sequences(b, torch.arange(3), old) == 2.0
    assert update._sequences(b, torch.arange(3), None) == 3.0
    token_mean = PolicyUpdate(
        SimpleNamespace(device="cpu"), LearnerConfig(correction=CorrectionConfig(mode="seq_mis")), pad_id=0
    )
    assert token_mean.old_up_front is None  # token-mean needs no π_old up front


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_weights_match_verl_rollout_correction_weights(level):
    """verl rollout_corr_helper.compute_rollout_correction_weights (token / sequence, truncated at the
    threshold, log-ratios clamped to ±20, detached; no batch normalisation) = Relay's tis / seq_tis."""
    g = torch.Generator().manual_seed(10)
    mask = _masks(torch.tensor([6, 3, 0, 5]), 6)
    old = torch.randn(4, 6, generator=g) * 0.3 - 1
    mu = old + torch.randn(4, 6, generator=g) * 0.8
    log_ratio = (old - mu) * mask
    if level == "token":
        want = torch.exp(log_ratio.clamp(-20, 20)).clamp(max=2.0)
    else:
        want = torch.exp(log_ratio.sum(-1, keepdim=True).clamp(-20, 20)).expand_as(old).clamp(max=2.0)
    mode = "tis" if level == "token" else "seq_tis"
    w, keep = importance_weights(old, mu, mask, CorrectionConfig(mode=mode, tis_cap=2.0))
    assert torch.allclose(w * mask, want * mask, atol=1e-6) and torch.equal(keep, mask)
    assert 0 < int(((want < 2.0) & mask.bool()).sum()) < int(mask.sum())  # some truncated, some not


def test_cispo_matches_verl_compute_policy_loss_cispo_without_a_lower_clip():
    """verl compute_policy_loss_cispo: −sg(clamp(r, 1 − ε_low, 1 + ε_high))·A·log π. Relay's cispo clips
    only above (MiniMax-M1), which is verl's with ε_low = 1."""
    g = torch.Generator().manual_seed(11)
    old = torch.randn(3, 5, generator=g) * 0.3 - 1
    logp = (old + torch.randn(3, 5, generator=g) * 0.6).requires_grad_()
    a = torch.randn(3, 5, generator=g)
    mask = _masks(torch.tensor([5, 2, 4]), 5)
    r = torch.exp((logp - old).clamp(-20, 20))
    want_mat = -r.clamp(1 - 1.0, 1 + 0.28).detach() * a * logp
    cfg = PolicyLossConfig(policy_loss="cispo", clip_eps_high=0.28, correction=CorrectionConfig(mode="none"))
    loss, _ = compute_policy_loss(logp, old, old, a, mask, cfg)
    want = verl_agg_loss(want_mat, mask, "token-mean")
    assert torch.allclose(loss, want, atol=1e-6)
    (g1,) = torch.autograd.grad(loss, logp, retain_graph=True)
    (g2,) = torch.autograd.grad(want, logp)
    assert torch.allclose(g1, g2, atol=1e-9)
