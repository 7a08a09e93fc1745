"""Exact tests of the learner's algorithms: on-policy identities, analytic off-policy gradients on
enumerable problems, V-trace against a double loop, and the formulas of verl's core_algos.py
(written out here from the formulas, each test naming the function it mirrors)."""

import itertools
import math

import pytest
import torch

from learner import advantages as adv
from learner.config import CorrectionConfig, PolicyLossConfig
from learner.correction import CORRECTIONS, importance_weights
from learner.diagnostics import effective_sample_size
from learner.losses import (
    AGGREGATIONS,
    aggregate,
    compute_policy_loss,
    cispo_loss_mat,
    kl_estimate,
    ppo_loss_mat,
    reinforce_loss_mat,
)


@pytest.fixture(autouse=True)
def float64():
    """Exact comparisons in double precision, restored afterwards (other tests expect float32)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _random(seed=0, B=5, T=7, V=6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    a = torch.randn(B, 1, generator=g).expand(B, T).clone()
    mask = torch.ones(B, T)
    for b in range(B):
        mask[b, int(torch.randint(2, T + 1, (1,), generator=g)) :] = 0
    return logits, tokens, a, mask, g


def _logp(logits, tokens):
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


# ----------------------------------------------------------------------------------------------
# on-policy: every weight is exactly 1, every mode is plain policy gradient


@pytest.mark.parametrize("mode", CORRECTIONS)
@pytest.mark.parametrize("policy", ["ppo", "cispo", "reinforce"])
def test_on_policy_every_correction_is_plain_policy_gradient(mode, policy):
    logits, tokens, a, mask, _ = _random(1)
    logp = _logp(logits, tokens)
    w, keep = importance_weights(logp.detach(), logp.detach(), mask, CorrectionConfig(mode=mode, tis_cap=2.0))
    assert torch.equal(w, torch.ones_like(w)) and torch.equal(keep, mask)
    loss, diag = compute_policy_loss(
        logp,
        logp.detach(),
        logp.detach(),
        a,
        mask,
        PolicyLossConfig(policy_loss=policy, correction=CorrectionConfig(mode=mode)),
    )
    assert diag["ess"] == 1.0 and diag["ratio_min"] == 1.0 and diag["ratio_max"] == 1.0
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    plain = -(logp * a * mask).sum() / mask.sum()
    (grad_plain,) = torch.autograd.grad(plain, logits, retain_graph=True)
    assert torch.allclose(grad, grad_plain, atol=1e-12)
    expected_value = -(a * mask).sum() / mask.sum() if policy == "ppo" else plain.detach()
    assert torch.allclose(loss, expected_value, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# enumerable problems with a fixed behaviour μ ≠ π


def test_bandit_corrected_gradient_is_the_analytic_one():
    """J(θ) = Σ_a π_θ(a) R(a). With every action 'sampled' in proportion to μ (exact expectation,
    encoded in the advantages as K·μ(a)·R(a) under token-mean), the importance-corrected loss has
    gradient −∇J exactly; the uncorrected one has −Σ μ R ∇log π, which is not."""
    K = 4
    theta = torch.tensor([0.3, -0.2, 1.0, 0.1], requires_grad=True)
    mu = torch.tensor([0.4, 0.3, 0.2, 0.1])
    R = torch.tensor([1.0, 0.0, 0.5, 2.0])
    pi = torch.softmax(theta, 0)
    (analytic,) = torch.autograd.grad(-(pi * R).sum(), theta)
    tokens = torch.arange(K)[:, None]
    mask = torch.ones(K, 1)
    a = (K * mu * R)[:, None]
    for mode, cap in (("tis", 1e9), ("decoupled", None), ("seq_tis", None)):
        logp = torch.log_softmax(theta, 0)[tokens]
        loss, _ = compute_policy_loss(
            logp,
            logp.detach(),
            torch.log(mu)[tokens],
            a,
            mask,
            PolicyLossConfig(correction=CorrectionConfig(mode=mode, tis_cap=cap)),
        )
        (g,) = torch.autograd.grad(loss, theta)
        assert torch.allclose(g, analytic, atol=1e-6), mode
    logp = torch.log_softmax(theta, 0)[tokens]
    loss, _ = compute_policy_loss(
        logp, logp.detach(), torch.log(mu)[tokens], a, mask, PolicyLossConfig(correction=CorrectionConfig(mode="none"))
    )
    (g_none,) = torch.autograd.grad(loss, theta)
    assert (g_none - analytic).abs().max() > 1e-2


def test_length_two_token_tree_needs_sequence_level_weights():
    """Sequences (x1, x2) over a 3-token vocabulary; π(x1, x2) = π(x1) π(x2 | x1) from a tabular
    policy; μ a different fixed tabular policy. Exact expectation over the 9 sequences. Sequence-level
    IS reproduces the analytic gradient of J = E_π[R]; token-level TIS is biased here (the prefix
    distribution differs too); no correction is wrong."""
    V = 3
    g = torch.Generator().manual_seed(3)
    th1 = torch.randn(V, generator=g, requires_grad=True)
    th2 = torch.randn(V, V, generator=g, requires_grad=True)
    mu1 = torch.softmax(torch.randn(V, generator=g), 0)
    mu2 = torch.softmax(torch.randn(V, V, generator=g), 1)
    R = torch.rand(V, V, generator=g)
    seqs = torch.tensor(list(itertools.product(range(V), range(V))))

    def logp_seq():
        lp1 = torch.log_softmax(th1, 0)[seqs[:, 0]]
        lp2 = torch.log_softmax(th2, 1)[seqs[:, 0], seqs[:, 1]]
        return torch.stack([lp1, lp2], 1)

    lp = logp_seq()
    J = (lp.sum(1).exp() * R[seqs[:, 0], seqs[:, 1]]).sum()
    analytic = torch.autograd.grad(-J, (th1, th2))
    mu_lp = torch.stack([torch.log(mu1[seqs[:, 0]]), torch.log(mu2[seqs[:, 0], seqs[:, 1]])], 1)
    mu_seq = mu_lp.sum(1).exp()
    n = len(seqs)
    # seq-mean-token-sum: the sequence's score-function gradient, weighted by n·μ(seq) = expectation
    a = (n * mu_seq * R[seqs[:, 0], seqs[:, 1]])[:, None].expand(n, 2)
    mask = torch.ones(n, 2)

    def grad(mode):
        lp = logp_seq()
        loss, _ = compute_policy_loss(
            lp,
            lp.detach(),
            mu_lp,
            a,
            mask,
            PolicyLossConfig(aggregation="seq-mean-token-sum", correction=CorrectionConfig(mode=mode, tis_cap=None)),
        )
        return torch.autograd.grad(loss, (th1, th2))

    for got, want in zip(grad("seq_tis"), analytic):
        assert torch.allclose(got, want, atol=1e-6)
    for mode in ("none", "tis"):
        assert max(float((x - y).abs().max()) for x, y in zip(grad(mode), analytic)) > 1e-3, mode


def test_masking_modes_drop_what_is_outside_the_interval():
    old = torch.log(torch.tensor([[1.0, 1.0, 1.0, 1.0]]))
    mu = torch.log(torch.tensor([[1.0, 0.1, 4.0, 0.25]]))  # ρ = 1, 10, 0.25, 4
    mask = torch.ones(1, 4)
    _, keep = importance_weights(old, mu, mask, CorrectionConfig(mode="token_mis", mask_lo=0.5, mask_hi=5.0))
    assert keep.tolist() == [[1.0, 0.0, 0.0, 1.0]]
    w, keep = importance_weights(old, mu, mask, CorrectionConfig(mode="icepop", mask_lo=0.5, mask_hi=5.0))
    assert keep.tolist() == [[1.0, 1.0, 1.0, 1.0]] and torch.allclose(w, torch.tensor([[1.0, 0.0, 0.0, 4.0]]))
    _, keep = importance_weights(old, mu, mask, CorrectionConfig(mode="mis", mask_hi=5.0))
    assert keep.tolist() == [[1.0, 0.0, 1.0, 1.0]]
    # geometric mean of ρ: (1·10·0.25·4)^(1/4) = 10^(1/4) ≈ 1.78 -> kept; sequence product 10 -> masked
    _, keep = importance_weights(old, mu, mask, CorrectionConfig(mode="geo_mis", mask_lo=0.5, mask_hi=5.0))
    assert keep.sum() == 4
    _, keep = importance_weights(old, mu, mask, CorrectionConfig(mode="seq_mis", mask_lo=0.5, mask_hi=5.0))
    assert keep.sum() == 0
    w, _ = importance_weights(old, mu, mask, CorrectionConfig(mode="tis", tis_cap=2.0))
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.25, 2.0]]))


# ----------------------------------------------------------------------------------------------
# advantages


def test_rloo_is_leave_one_out():
    r = torch.tensor([0.1, 0.7, 0.3, 1.0, 0.0])
    G = len(r)
    loo = torch.stack([r[i] - torch.cat([r[:i], r[i + 1 :]]).mean() for i in range(G)])
    assert torch.allclose(adv.rloo(r), loo, atol=1e-12)
    assert torch.allclose(adv.rloo(r), G / (G - 1) * (r - r.mean()), atol=1e-12)


@pytest.mark.parametrize("fn", [adv.grpo, adv.drgrpo, adv.rloo])
def test_equal_rewards_give_zero_advantage(fn):
    assert torch.equal(fn(torch.full((6,), 0.4)), torch.zeros(6))


def test_grpo_matches_verl_compute_grpo_outcome_advantage():
    """verl compute_grpo_outcome_advantage: (s − mean) / (std + ε), torch.std (unbiased);
    norm_adv_by_std_in_grpo=False: s − mean; a group of one gets mean 0 and std 1."""
    g = torch.Generator().manual_seed(7)
    r = torch.rand(8, generator=g)
    mean, std = r.sum() / 8, math.sqrt(float(((r - r.sum() / 8) ** 2).sum()) / 7)
    assert torch.allclose(adv.grpo(r), (r - mean) / (std + 1e-6), atol=1e-6)
    assert torch.allclose(adv.drgrpo(r), r - mean, atol=1e-6)


def test_reinforce_pp_matches_verl():
    """verl compute_reinforce_plus_plus_outcome_advantage (γ = 1: the return at every token is the
    sequence reward) and ..._baseline_outcome_advantage (group mean subtracted first), each
    whitened over the batch's tokens with masked_whiten (unbiased variance, eps 1e-8); Relay's
    per-sample value is the (constant) per-token one."""
    g = torch.Generator().manual_seed(5)
    r = torch.rand(6, generator=g)
    mask = torch.tensor(
        [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64
    )

    def whiten(x):
        vals = [float(x[i, j]) for i in range(6) for j in range(4) if mask[i, j]]
        m = sum(vals) / len(vals)
        var = sum((v - m) ** 2 for v in vals) / (len(vals) - 1)
        return (x - m) / math.sqrt(var + 1e-8) * mask

    want = whiten(r[:, None] * mask)
    n = mask.sum(-1)
    assert torch.allclose(adv.reinforce_pp(r, n)[:, None] * mask, want, atol=1e-6)
    idx = torch.tensor([0, 0, 0, 1, 1, 1])
    rb = r.clone()
    for k in (0, 1):
        rb[idx == k] -= r[idx == k].mean()
    assert torch.allclose(adv.reinforce_pp(r, n, idx)[:, None] * mask, whiten(rb[:, None] * mask), atol=1e-6)


def test_gae_matches_verl_recursion():
    """verl compute_gae_advantage_return (before whitening): δ_t = r_t + γ V_{t+1} − V_t,
    A_t = δ_t + γλ A_{t+1}, skipping masked tokens; returns = A + V."""
    g = torch.Generator().manual_seed(11)
    B, T, gamma, lam = 3, 6, 0.9, 0.8
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.float64)
    want = torch.zeros(B, T)
    for b in range(B):
        n = int(mask[b].sum())
        last = 0.0
        for t in reversed(range(n)):
            nv = float(v[b, t + 1]) if t + 1 < n else 0.0
            last = float(r[b, t]) + gamma * nv - float(v[b, t]) + gamma * lam * last
            want[b, t] = last
        for t in range(n, T):
            want[b, t] = want[b, n - 1] if n else 0.0  # verl carries the last value through padding
    got, ret = adv.gae(r, v, mask, gamma, lam)
    assert torch.allclose(got * mask, want * mask, atol=1e-6)
    assert torch.allclose(ret, got + v)


def _vtrace_double_loop(r, v, log_rho, gamma, rho_bar, c_bar):
    """v_s = V_s + Σ_{t≥s} γ^{t−s} (Π_{i=s}^{t−1} c_i) ρ_t δ_t, bootstrap 0 after the end."""
    T = len(r)
    rho = [min(rho_bar, math.exp(x)) for x in log_rho]
    c = [min(c_bar, math.exp(x)) for x in log_rho]
    out = []
    for s in range(T):
        total = float(v[s])
        for t in range(s, T):
            prod = 1.0
            for i in range(s, t):
                prod *= c[i]
            nv = float(v[t + 1]) if t + 1 < T else 0.0
            total += gamma ** (t - s) * prod * rho[t] * (float(r[t]) + gamma * nv - float(v[t]))
        out.append(total)
    return torch.tensor(out)


def test_vtrace_matches_double_loop_and_on_policy_is_the_n_step_return():
    g = torch.Generator().manual_seed(2)
    T, gamma = 6, 0.95
    r, v = torch.randn(1, T, generator=g), torch.randn(1, T, generator=g)
    log_rho = torch.randn(1, T, generator=g) * 0.7
    mask = torch.ones(1, T)
    vs, _ = adv.vtrace(r, v, log_rho, mask, gamma, rho_bar=1.2, c_bar=0.9)
    assert torch.allclose(vs[0], _vtrace_double_loop(r[0], v[0], log_rho[0], gamma, 1.2, 0.9), atol=1e-9)
    vs_on, _ = adv.vtrace(r, v, torch.zeros(1, T), mask, gamma)
    n_step = torch.tensor([sum(gamma ** (t - s) * float(r[0, t]) for t in range(s, T)) for s in range(T)])
    assert torch.allclose(vs_on[0], n_step, atol=1e-9)


# ----------------------------------------------------------------------------------------------
# policy losses against verl's formulas


def test_ppo_matches_verl_compute_policy_loss_vanilla():
    """verl compute_policy_loss_vanilla: pg1 = −A r, pg2 = −A clip(r, 1−ε_low, 1+ε_high),
    clip1 = max(pg1, pg2); pg3 = −A c; loss = A < 0 ? min(pg3, clip1) : clip1."""
    g = torch.Generator().manual_seed(4)
    logp, old = torch.randn(4, 5, generator=g) * 0.3 - 1, torch.randn(4, 5, generator=g) * 0.3 - 1
    a = torch.randn(4, 5, generator=g)
    r = torch.exp(logp - old)
    clip1 = torch.maximum(-a * r, -a * r.clamp(1 - 0.1, 1 + 0.28))
    want = torch.where(a < 0, torch.minimum(-a * 3.0, clip1), clip1)
    got, _ = ppo_loss_mat(logp, old, a, clip_low=0.1, clip_high=0.28, dual_clip=3.0)
    assert torch.allclose(got, want, atol=1e-6)


def test_cispo_and_truncated_reinforce_gradients():
    """CISPO: ∇ℓ = −sg(clip(r, ·, 1+ε_high)) A ∇log π; truncated REINFORCE: −sg(min(r, c)) A ∇log π."""
    logits, tokens, a, mask, g = _random(6)
    logp = _logp(logits, tokens)
    old = logp.detach() + torch.randn(logp.shape, generator=g) * 0.5
    r = torch.exp(logp.detach() - old)
    for mat_fn, w in (
        (lambda: cispo_loss_mat(logp, old, a, clip_high=0.2)[0], r.clamp(max=1.2)),
        (lambda: reinforce_loss_mat(logp, old, a, cap=1.0)[0], r.clamp(max=1.0)),
    ):
        (got,) = torch.autograd.grad((mat_fn() * mask).sum(), logits, retain_graph=True)
        (want,) = torch.autograd.grad((-w * a * logp * mask).sum(), logits, retain_graph=True)
        assert torch.allclose(got, want, atol=1e-9)


def test_aggregation_modes_match_verl_agg_loss():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 4, generator=g)
    m = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    want = {
        "token-mean": (x * m).sum() / m.sum(),
        "seq-mean-token-sum": (x * m).sum(-1).mean(),
        "seq-mean-token-mean": ((x * m).sum(-1) / m.sum(-1)).mean(),
        "seq-mean-token-sum-norm": (x * m).sum(-1).mean() / 4,
    }
    assert set(want) == set(AGGREGATIONS)
    for mode, w in want.items():
        assert torch.allclose(aggregate(x, m, mode), w, atol=1e-12), mode


# ----------------------------------------------------------------------------------------------
# KL estimators and ESS


def test_k1_and_k3_are_unbiased_kl_by_enumeration():
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    kl = (p * (p.log() - q.log())).sum()
    for kind in ("k1", "k3"):
        assert torch.allclose((p * kl_estimate(p.log(), q.log(), kind)).sum(), kl, atol=1e-12), kind
    assert (kl_estimate(p.log(), q.log(), "k3") >= 0).all()
    k2 = (p * kl_estimate(p.log(), q.log(), "k2")).sum()
    assert not torch.allclose(k2, kl)  # k2 is biased (but low variance)


def test_ess_is_one_for_equal_weights_and_one_over_n_for_one_hot():
    equal = torch.full((8,), 0.3)
    assert effective_sample_size(float(equal.sum()), float((equal**2).sum()), 8) == pytest.approx(1.0)
    one_hot = torch.zeros(8)
    one_hot[3] = 5.0
    assert effective_sample_size(float(one_hot.sum()), float((one_hot**2).sum()), 8) == pytest.approx(1 / 8)
