"""KL in the reward (verl ``use_kl_in_reward``): each sample's reward minus β Σ_t kl(π_old, π_ref)
before the advantage estimator, in place of the KL loss; checked against verl's ``apply_kl_penalty`` /
``compute_rewards`` followed by ``compute_grpo_outcome_advantage``, with full-logit log-probs."""

import numpy as np
import pytest
import torch

from broker.protocol.group import Sample
from learner.advantages import drgrpo, grpo
from learner.config import LearnerConfig
from learner.data import collate
from learner.update import PolicyUpdate
from tests.support.data import make_group

SAMPLING = {"temperature": 1.0, "n": 3}


class PlainEngine(torch.nn.Module):
    """What PolicyUpdate uses of a DeepSpeed engine, on a plain model and SGD."""

    def __init__(self, model):
        super().__init__()
        self.module, self.device = model, torch.device("cpu")
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def forward(self, **kw):
        return self.module(**kw)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()
        self.opt.zero_grad()

    def zero_optimization_stage(self):
        return 0

    def get_global_grad_norm(self):
        return None  # as DeepSpeed's engine at ZeRO 0 in fp32: the learner's own norm is reported

    def get_lr(self):
        return [g["lr"] for g in self.opt.param_groups]


def _model(seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=15,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg).eval()


def _groups():
    rng = np.random.default_rng(0)

    def sample(t, reward):
        return Sample(rng.integers(3, 13, t).astype(np.int32), np.full(t, -2.0, np.float32), [[0, t]], "stop", reward)

    return [
        make_group(samples=[sample(3, 1.0), sample(5, 0.0), sample(2, 1.0)], sampling=SAMPLING),
        make_group(samples=[sample(4, 0.5), sample(4, 0.25), sample(1, 0.0)], sampling=SAMPLING),
    ]


def _full_logit_logprobs(model, prompt, completion):
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
    return lp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)


def test_kl_in_reward_matches_verl_compute_rewards_then_grpo():
    policy, reference = _model(0), _model(1)
    cfg = LearnerConfig(kl_coef=0.3, kl_in_reward=True, kl_estimator="k3", advantage="grpo")
    update = PolicyUpdate(PlainEngine(policy), cfg, pad_id=0, reference=reference)
    groups = _groups()
    rewards, tokens = update._rewards(groups)
    b = collate(groups, [torch.zeros(len(r)) for r in rewards], 0, 0)
    transform = (1.0, 0, 1.0)
    old = update._old_logprobs(b, torch.arange(len(b.lengths)), transform)
    kl, n = update._sequence_kl(b, old, transform)
    # verl: kld = kl_penalty(old_log_prob, ref_log_prob, "low_var_kl") per token; token rewards = score on
    # the last token − β kld; the outcome estimator sums them: R − β Σ_t kld_t
    want_kl = []
    for g in groups:
        for s in g.samples:
            lo, lr = (_full_logit_logprobs(m, g.prompt_ids, s.completion_ids) for m in (policy, reference))
            d = (lr - lo).clamp(-20, 20)
            want_kl.append(float((torch.exp(d) - d - 1).clamp(-10, 10).sum()))
    assert kl.tolist() == pytest.approx(want_kl, abs=1e-5) and n == sum(
        len(s.completion_ids) for g in groups for s in g.samples
    )
    assert min(want_kl) > 1e-3  # two different models: a real KL
    for gi, g in enumerate(groups):
        scores = torch.tensor(
            [s.reward - 0.3 * want_kl[3 * gi + i] for i, s in enumerate(g.samples)], dtype=torch.float64
        )
        want = (scores - scores.mean()) / (scores.std() + 1e-6)  # verl compute_grpo_outcome_advantage
        penalised = rewards[gi] - 0.3 * kl[3 * gi : 3 * gi + 3].float()
        assert grpo(penalised).tolist() == pytest.approx(want.tolist(), abs=1e-4)


def test_train_step_puts_the_kl_in_the_reward_not_the_loss():
    """One on-policy update (r = 1, no correction, token-mean): the loss is −Σ_i A_i n_i / Σ_i n_i with
    A the drgrpo advantages of R − β Σ_t kl; a KL term also in the loss would add β·kl_ref."""
    cfg = LearnerConfig(kl_coef=0.5, kl_in_reward=True, advantage="drgrpo", correction={"mode": "none"})
    update = PolicyUpdate(PlainEngine(_model(0)), cfg, pad_id=0, reference=_model(1))
    groups = _groups()
    rewards, tokens = update._rewards(groups)
    b = collate(groups, [torch.zeros(len(r)) for r in rewards], 0, 0)
    transform = (1.0, 0, 1.0)
    kl, n = update._sequence_kl(b, update._old_logprobs(b, torch.arange(len(b.lengths)), transform), transform)
    adv = torch.cat([drgrpo(r.double() - 0.5 * k) for r, k in zip(rewards, kl.split(3))])
    want = float(-(adv * torch.cat(tokens)).sum() / torch.cat(tokens).sum())
    diag = update.train_step(groups, SAMPLING, 0)
    assert diag["kl_ref"] == pytest.approx(float(kl.sum()) / n) and diag["kl_ref"] > 1e-3
    assert diag["loss"] == pytest.approx(want, abs=1e-5)
    assert abs(want) > 1e-3 and abs(diag["loss"] - want) < 0.1 * 0.5 * diag["kl_ref"]
    with pytest.raises(ValueError, match="kl_in_reward needs kl_coef"):
        LearnerConfig(kl_in_reward=True)
