"""π_old from the loss forward (``learner.compute.old_logprobs_from_loss``, learner/update.py
``old_logprobs_up_front``): with one optimizer step per batch, a train step that takes π_old from each loss
micro-batch's own forward, detached, gives the loss, the gradients (fp32, 1e-5) and every diagnostic of the
step that computes π_old with a forward of its own first, with one full forward of the batch less; where
something needs π_old before the micro-batches run, that forward still runs."""

import logging

import pytest
import torch

from broker.protocol.group import sampling_transform
from learner.config import LearnerConfig
from learner.critic import ValueModel
from learner.update import PolicyUpdate, old_logprobs_up_front
from tests.support.learner_cases import mixed_groups

TOP = {"temperature": 0.8, "top_k": 6, "top_p": 0.95, "n": 3}  # tokens outside the kept set: masked
PLAIN = {"temperature": 0.8, "n": 3}  # every token kept (a seq-mean mode counts the same sequences either way)


class CountingEngine(torch.nn.Module):
    """What PolicyUpdate uses of a DeepSpeed engine, on a plain model: counts the model's forwards, keeps the
    gradient of each optimizer step and updates no weight (every step of a test starts from the same ones)."""

    def __init__(self, model):
        super().__init__()
        self.module, self.device, self.forwards, self.grads = model, torch.device("cpu"), 0, []
        model.register_forward_pre_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    def forward(self, *args, **kw):
        return self.module(*args, **kw)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.grads.append({n: p.grad.clone() for n, p in self.module.named_parameters() if p.grad is not None})
        self.module.zero_grad()

    def zero_optimization_stage(self):
        return 0

    def get_global_grad_norm(self):
        return None

    def get_lr(self):
        return [1e-3]


def _model(seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=15,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=32,
    )
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(4.0)  # sharp enough that top-k/top-p leave tokens out
    return m


def _step(from_loss: bool, sampling=TOP, shared_prompt=True, estimator="grpo", **cfg):
    """One train step of fresh models in micro-batches of 24 tokens: its diagnostics, the policy's (and the
    critic's) gradients, the policy model's forwards and why π_old had a forward of its own (None: it had not)."""
    compute = {"micro_batch_tokens": 24, "logprob_chunk_tokens": 5, "shared_prompt": shared_prompt}
    cfg = LearnerConfig(
        compute={**compute, **cfg.pop("compute", {}), "old_logprobs_from_loss": from_loss},
        loss_scale_tokens=10,
        advantages={"estimator": estimator},
        critic={"enabled": estimator in ("gae", "vtrace")},
        **cfg,
    )
    engine = CountingEngine(_model(0))
    critic = None
    if cfg.critic.enabled:
        trunk = _model(2).model
        critic = CountingEngine(ValueModel(trunk, trunk.config.hidden_size))
    reference = _model(1) if cfg.regularization.kl_coef else None
    update = PolicyUpdate(engine, cfg, pad_id=0, reference=reference, critic=critic)
    diag = update.train_step(mixed_groups(sampling), sampling, version=1)
    why = old_logprobs_up_front(cfg, reference is not None, sampling_transform(sampling))
    return diag, engine.grads + (critic.grads if critic else []), engine.forwards, why


def _assert_same_step(a, b):
    (da, ga, *_), (db, gb, *_) = a, b
    assert set(da) == set(db)
    for k in da:
        if isinstance(da[k], float) and k != "compute_s":
            assert da[k] == pytest.approx(db[k], abs=1e-5, rel=1e-5), k
        elif k != "compute_s":
            assert da[k] == db[k], k  # counts, the staleness histogram, None where nothing was measured
    assert len(ga) == len(gb) >= 1
    for want, got in zip(ga, gb):
        assert set(got) == set(want) and len(want) > 5
        for n in want:
            assert torch.allclose(got[n], want[n], atol=1e-5, rtol=1e-4), (n, (got[n] - want[n]).abs().max())


CASES = {
    "token-mean-tis": {},
    "token-mean-tis-whole-rows": {"shared_prompt": False},
    "token-mean-tis-packed": {"compute": {"packing": True}},
    "token-mean-icepop": {"correction": {"mode": "icepop", "mask_lo": 0.5, "mask_hi": 2.0}},
    "token-mean-icepop-whole-rows": {"correction": {"mode": "icepop"}, "shared_prompt": False},
    "token-mean-token_mis-packed": {"correction": {"mode": "token_mis"}, "compute": {"packing": True}},
    "token-mean-seq_mis": {"correction": {"mode": "seq_mis", "mask_lo": 0.2, "mask_hi": 5.0}},
    "token-mean-seq_tis": {"correction": {"mode": "seq_tis"}},
    "token-mean-none-clip": {"correction": {"mode": "none"}, "policy_loss": "ppo"},
    "kl-loss-entropy": {"regularization": {"kl_coef": 0.1, "entropy_coef": 0.01}},
    "seq-mean-token-mean-tis": {"aggregation": "seq-mean-token-mean", "sampling": PLAIN},
    "seq-mean-token-sum-norm-icepop-packed": {
        "aggregation": "seq-mean-token-sum-norm",
        "correction": {"mode": "icepop"},
        "sampling": PLAIN,
        "compute": {"packing": True},
    },
    "gae-critic": {"estimator": "gae"},
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_pi_old_from_the_loss_forward_gives_the_same_step_with_one_forward_of_the_batch_less(case):
    shortcut = _step(True, **case)
    separate = _step(False, **case)
    assert shortcut[3] is None and "old_logprobs_from_loss is off" in separate[3]
    _assert_same_step(separate, shortcut)
    d = shortcut[0]
    assert d["micro_batches"] >= 3 and d["tokens"] == 33  # really split; every completion token trained
    assert d["ratio_min"] < 0.9 < 1.1 < d["ratio_max"]  # π_old/μ far from 1: the correction weights matter
    if case.get("sampling") is not PLAIN:
        assert d["tokens_outside_kept_set"] > 0  # the kept-set mask is π_old's in both
    # the forward over the batch that computes π_old is gone: the policy runs the loss forwards alone
    assert separate[2] == 2 * shortcut[2] > 0


NOT_TAKEN = {
    "two-epochs": ({"optim": {"ppo_epochs": 2}}, "2 epoch(s)"),
    "two-minibatches": ({"optim": {"minibatches": 2}}, "2 minibatch(es)"),
    "kl-in-reward": ({"regularization": {"kl_coef": 0.1, "kl_in_reward": True}}, "kl_in_reward"),
    "seq-mean-seq_mis": ({"aggregation": "seq-mean-token-mean", "correction": {"mode": "seq_mis"}}, "seq_mis"),
    "seq-mean-token_mis": (
        {"aggregation": "seq-mean-token-sum-norm", "correction": {"mode": "token_mis"}},
        "token_mis",
    ),
    # a sequence whose every token falls outside π_old's kept set is not counted: the tis case of CASES under top-k
    "seq-mean-top-k": ({"aggregation": "seq-mean-token-mean"}, "top-k/top-p"),
    "vtrace": ({"estimator": "vtrace"}, "vtrace"),
}


@pytest.mark.parametrize("case,why", NOT_TAKEN.values(), ids=NOT_TAKEN.keys())
def test_the_forward_of_its_own_runs_where_pi_old_is_needed_before_the_micro_batches(case, why, monkeypatch):
    calls = []
    original = PolicyUpdate._old_logprobs
    monkeypatch.setattr(PolicyUpdate, "_old_logprobs", lambda self, *a: calls.append(1) or original(self, *a))
    on, off = _step(True, **case), _step(False, **case)
    assert why in on[3]
    assert calls == [1, 1]  # once per step, both with the shortcut on and off
    assert on[2] == off[2]  # the same forwards
    _assert_same_step(off, on)


def test_the_condition_and_the_start_up_line(caplog):
    assert old_logprobs_up_front(LearnerConfig(), reference=False) is None
    kl = LearnerConfig(regularization={"kl_coef": 0.1, "kl_in_reward": True})
    assert "kl_in_reward" in old_logprobs_up_front(kl, reference=True)
    gae = LearnerConfig(advantages={"estimator": "gae"}, critic={"enabled": True})
    assert old_logprobs_up_front(gae, reference=False) is None  # the critic's gae targets use the values alone
    seq = LearnerConfig(aggregation="seq-mean-token-sum")
    assert old_logprobs_up_front(seq, False, (0.7, 0, 1.0)) is None
    assert "top-k/top-p" in old_logprobs_up_front(seq, False, (0.7, 0, 0.95))
    assert "top-k/top-p" in old_logprobs_up_front(seq, False, (0.7, 20, 1.0))
    assert old_logprobs_up_front(LearnerConfig(), False, (0.7, 20, 0.95)) is None  # token-mean: any transform
    with caplog.at_level(logging.INFO, logger="relay.learner"):
        PolicyUpdate(CountingEngine(_model(0)), LearnerConfig(), pad_id=0)
        PolicyUpdate(CountingEngine(_model(0)), LearnerConfig(optim={"minibatches": 2}), pad_id=0, rank=1, world=2)
        PolicyUpdate(CountingEngine(_model(0)), LearnerConfig(optim={"minibatches": 2}), pad_id=0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pi_old")]
    assert len(lines) == 2  # the leader's alone
    assert "each loss micro-batch's own forward" in lines[0]
    assert "a forward of its own" in lines[1] and "1 epoch(s) x 2 minibatch(es)" in lines[1]
