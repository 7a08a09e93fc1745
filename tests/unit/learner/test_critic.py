"""The critic (learner/critic.py) and the per-token estimators it feeds, against verl's formulas written
out here: ``compute_value_loss`` (every aggregation mode, fully masked rows) and
``compute_gae_advantage_return`` + ``masked_whiten`` on verl's response-only layout, with the critic's
values from a full forward of each sample alone (so the alignment of values, rewards and tokens is
checked too)."""

import pytest
import torch

from learner.config import LearnerConfig
from learner.critic import ValueModel, explained_variance, value_loss
from learner.data import collate
from learner.losses import AGGREGATIONS
from learner.update import PolicyUpdate
from tests.unit.learner.test_kl_in_reward import SAMPLING, PlainEngine, _groups, _model
from tests.unit.learner.test_verl_parity import verl_agg_loss


class CriticEngine(PlainEngine):
    """The critic's stand-in engine (positional inputs)."""

    def forward(self, *args):
        return self.module(*args)


def verl_compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode):
    """verl ``core_algos.compute_value_loss``: (vf_loss, vf_clipfrac)."""
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * verl_agg_loss(clipped_vf_losses, response_mask, loss_agg_mode)
    vf_clipfrac = (torch.gt(vf_losses2, vf_losses1).float() * response_mask).sum() / response_mask.sum()
    return vf_loss, vf_clipfrac


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """verl ``core_algos.compute_gae_advantage_return``: (whitened advantages, returns)."""
    nextvalues, lastgaelam, reversed_ = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    returns = advantages + values
    m = response_mask.bool()  # verl masked_whiten: unbiased masked variance, eps 1e-8
    mean = advantages[m].mean()
    var = advantages[m].var(unbiased=True)
    return (advantages - mean) * torch.rsqrt(var + 1e-8), returns


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_value_loss_matches_verl_compute_value_loss_with_fully_masked_rows(mode):
    g = torch.Generator().manual_seed(3)
    B, T = 7, 9
    vpreds, returns, values = (torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(3))
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).double()
    mask[2] = 0  # zero-length completions: no token, left out of the seq-mean denominators
    mask[5] = 0
    vpreds[2] = 1e3  # whatever a masked row holds counts for nothing
    want, want_frac = verl_compute_value_loss(vpreds, returns, values, mask, 0.2, mode)
    got, sums = value_loss(vpreds, values, returns, mask, 0.2, mode)
    assert float(got) == pytest.approx(float(want), abs=1e-6)
    assert sums["clipped"] / sums["tokens"] == pytest.approx(float(want_frac), abs=1e-6)
    assert 0 < float(want_frac) < 1  # both branches taken


def test_explained_variance_is_verls_vf_explained_var():
    g = torch.Generator().manual_seed(0)
    returns, values = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    m = mask.bool()
    want = 1 - (returns[m] - values[m]).var(unbiased=False) / returns[m].var(unbiased=False)
    assert explained_variance(returns, values, mask) == pytest.approx(float(want), abs=1e-6)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.ones(2, 3), values[:2, :3], torch.ones(2, 3)) == 0.0  # nothing to explain


def _critic(seed=2):
    trunk = _model(seed).model
    critic = ValueModel(trunk, trunk.config.hidden_size)
    torch.nn.init.normal_(critic.head.weight, std=0.5, generator=torch.Generator().manual_seed(seed))
    return critic


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_advantages_match_verl_with_the_reward_on_the_last_token(gamma, lam):
    cfg = LearnerConfig(advantage="gae", critic={"enabled": True}, gamma=gamma, lam=lam)
    critic = _critic()
    update = PolicyUpdate(PlainEngine(_model(0)), cfg, pad_id=0, critic=critic)
    groups = _groups()
    rewards, _ = update._rewards(groups)
    b = collate(groups, [torch.zeros(len(r)) for r in rewards], 0, 0)
    update._critic_targets(b, torch.cat(rewards), None)
    # verl's layout: one row per sample, its completion tokens left-aligned; V of the prefix before each
    samples = [(g.prompt_ids.tolist(), s.completion_ids.tolist(), s.reward) for g in groups for s in g.samples]
    T = max(len(c) for _, c, _ in samples)
    values, token_rewards, mask = (torch.zeros(len(samples), T) for _ in range(3))
    for i, (p, c, r) in enumerate(samples):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            v = critic(ids, torch.ones_like(ids))[0]
        values[i, : len(c)] = v[len(p) - 1 :]
        token_rewards[i, len(c) - 1] = r
        mask[i, : len(c)] = 1
    want_adv, want_ret = verl_gae(token_rewards.double(), values.double(), mask.double(), gamma, lam)
    start = [len(p) - 1 for p, _, _ in samples]
    for i, (_, c, _) in enumerate(samples):
        sl = slice(start[i], start[i] + len(c))
        assert b.advantages[i, sl].tolist() == pytest.approx(want_adv[i, : len(c)].tolist(), abs=1e-5)
        assert b.returns[i, sl].tolist() == pytest.approx(want_ret[i, : len(c)].tolist(), abs=1e-5)
        assert b.values[i, sl].tolist() == pytest.approx(values[i, : len(c)].tolist(), abs=1e-6)
    assert float(b.advantages[~b.loss_mask.bool()].abs().max()) == 0.0
    assert float(values.abs().max()) > 0.1  # a real critic, not zeros


def test_vtrace_on_policy_targets_are_the_return_and_the_step_reports_the_critic():
    """On-policy (μ = π_old, ρ = 1) with γ = 1 the V-trace targets are the outcome reward at every token;
    a train step trains both models and reports the critic's diagnostics."""
    policy = _model(0)
    cfg = LearnerConfig(advantage="vtrace", critic={"enabled": True}, correction={"mode": "none"})
    critic = _critic()
    update = PolicyUpdate(PlainEngine(policy), cfg, pad_id=0, critic=CriticEngine(critic))
    groups = _groups()
    rewards, _ = update._rewards(groups)
    b = collate(groups, [torch.zeros(len(r)) for r in rewards], 0, 0)
    transform = (1.0, 0, 1.0)
    old = update._old_logprobs(b, torch.arange(len(b.lengths)), transform)
    b.behaviour_logp = old[0].clone()
    update._critic_targets(b, torch.cat(rewards), old)
    m = b.loss_mask.bool()
    want = (torch.cat(rewards)[:, None] * b.loss_mask)[m]
    assert b.returns[m].tolist() == pytest.approx(want.tolist(), abs=1e-5)
    before = [p.detach().clone() for p in critic.parameters()]
    diag = update.train_step(groups, SAMPLING, 0)
    assert {"value_loss", "value_clip_frac", "explained_variance", "values_mean"} <= diag.keys()
    assert diag["value_loss"] > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, critic.parameters()))  # the critic was trained
