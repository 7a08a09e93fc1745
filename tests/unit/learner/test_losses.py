import torch

from learner.advantages import grpo
from learner.config import CorrectionConfig, PolicyLossConfig
from learner.diagnostics import summarise
from learner.losses import compute_policy_loss, policy_loss_terms


def policy_loss(logp, old, mu, adv, mask, clip_eps, mode="tis", tis_cap=2.0):
    cfg = PolicyLossConfig(clip_eps=clip_eps, correction=CorrectionConfig(mode=mode, tis_cap=tis_cap))
    return compute_policy_loss(logp, old, mu, adv, mask, cfg)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 6, 5, generator=g, requires_grad=True)
    tokens = torch.randint(0, 5, (4, 6), generator=g)
    adv = torch.randn(4, 1, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    return logits, tokens, adv, mask


def _logp(logits, tokens):
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def test_on_policy_weights_are_exactly_one_and_loss_is_plain_policy_gradient():
    logits, tokens, adv, mask = _inputs()
    logp = _logp(logits, tokens)
    for mode in ("none", "tis"):
        loss, diag = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, clip_eps=0.2, mode=mode)
        assert diag["ratio_min"] == 1.0 and diag["ratio_max"] == 1.0 and diag["ess"] == 1.0
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        # plain policy gradient: value -mean(A) (ratio 1), gradient -mean(A ∇log π)
        plain = -(logp * adv * mask).sum() / mask.sum()
        (grad_plain,) = torch.autograd.grad(plain, logits, retain_graph=True)
        assert torch.allclose(loss, -(adv * mask).sum() / mask.sum())
        assert torch.allclose(grad, grad_plain, atol=1e-7)


def test_tis_weights_tokens_by_truncated_ratio():
    logits, tokens, adv, mask = _inputs(1)
    logp = _logp(logits, tokens)
    mu = logp.detach() - torch.log(torch.tensor(3.0))  # ρ = π_old/μ = 3 everywhere: truncated to C = 2
    loss_tis, diag = policy_loss(logp, logp.detach(), mu, adv, mask, 0.2, "tis", tis_cap=2.0)
    loss_none, _ = policy_loss(logp, logp.detach(), mu, adv, mask, 0.2, "none")
    assert torch.allclose(loss_tis, 2.0 * loss_none)
    assert diag["frac_truncated"] == 1.0
    assert abs(diag["mismatch_kl"] + torch.log(torch.tensor(3.0)).item()) < 1e-6


def test_the_fresh_mismatch_counts_only_samples_of_staleness_0():
    logits, tokens, adv, _ = _inputs(2)
    mask = torch.ones(4, 6)
    logp = _logp(logits, tokens).detach()
    mu = logp.clone()
    mu[2:] -= 0.5  # samples 2 and 3 are stale: sampled by other weights
    cfg = PolicyLossConfig(correction=CorrectionConfig(mode="tis"))
    _, sums = policy_loss_terms(logp, logp, mu, adv, mask, cfg, fresh=torch.tensor([True, True, False, False]))
    diag = summarise(sums)
    assert abs(diag["mismatch_kl"] + 0.25) < 1e-6 and diag["mismatch_kl_fresh"] == 0.0
    _, sums = policy_loss_terms(logp, logp, mu, adv, mask, cfg)  # none fresh: not a misleading 0
    assert summarise(sums)["mismatch_kl_fresh"] is None


def test_grpo_equal_rewards_give_zero_not_nan():
    assert torch.equal(grpo(torch.ones(8)), torch.zeros(8))
    assert torch.equal(grpo(torch.tensor([0.7])), torch.zeros(1))
    a = grpo(torch.tensor([0.0, 1.0, 0.0, 1.0]))
    assert torch.allclose(a.mean(), torch.tensor(0.0)) and torch.allclose(a.std(), torch.tensor(1.0), atol=1e-5)
