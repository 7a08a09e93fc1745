"""T of ``seq-mean-token-sum-norm`` is a constant of the run (``learner.loss_scale_tokens``, or the generation
budget relay up tells the learner), as in Dr.GRPO and verl: a batch with longer prompts trains with the same
loss, Σ_t ℓ / (S · T), and a learner that does not know T refuses to start."""

import numpy as np
import pytest
import torch

from broker.protocol.group import Sample
from broker.runtime.config import ConfigError, load_config
from learner.advantages import grpo
from learner.config import LearnerConfig
from learner.update import PolicyUpdate
from tests.support.data import make_group
from tests.unit.learner.test_kl_in_reward import SAMPLING, PlainEngine, _model


def _groups(second_prompt: int):
    """Two groups: the first learns (rewards 1, 0, 1), the second's rewards are all equal (advantage 0:
    it adds nothing to the loss but its samples to S) and its prompt has ``second_prompt`` tokens."""
    rng = np.random.default_rng(0)

    def sample(t, reward):
        return Sample(rng.integers(3, 13, t).astype(np.int32), np.full(t, -2.0, np.float32), [[0, t]], "stop", reward)

    first = make_group(samples=[sample(3, 1.0), sample(5, 0.0), sample(2, 1.0)], sampling=SAMPLING)
    second = make_group(
        samples=[sample(4, 0.5), sample(2, 0.5)],
        prompt_ids=np.array([1, *rng.integers(3, 13, second_prompt - 2), 14], np.int32),
        sampling=SAMPLING,
    )
    return [first, second]


def _loss(groups, **cfg) -> float:
    """The reported loss of one train step (one update: π_old = π_θ, ratio 1; no correction)."""
    cfg = LearnerConfig(aggregation="seq-mean-token-sum-norm", correction={"mode": "none"}, **cfg)
    return PolicyUpdate(PlainEngine(_model(0)), cfg, pad_id=0).train_step(groups, SAMPLING, version=0)["loss"]


def test_longer_prompts_leave_the_loss_as_it_is_and_it_is_the_sum_over_s_times_t():
    short, long = _groups(3), _groups(20)
    assert len(long[1].prompt_ids) + 4 > len(short[0].prompt_ids) + 5  # the longest row is another one
    got = _loss(short, loss_scale_tokens=16)
    assert _loss(long, loss_scale_tokens=16) == pytest.approx(got, rel=1e-6)
    # ppo at ratio 1: ℓ = −A on every completion token; S = 5 samples with a loss token, T = 16
    adv = grpo(torch.tensor([1.0, 0.0, 1.0]))
    want = -float((adv * torch.tensor([3.0, 5.0, 2.0])).sum()) / (5 * 16)
    assert got == pytest.approx(want, rel=1e-5) and abs(want) > 0.01
    # the generation budget relay up gives the learner is T when loss_scale_tokens is 0
    assert _loss(short, batch={"max_completion_tokens": 8}) == pytest.approx(want * 16 / 8, rel=1e-5)


def test_a_learner_that_does_not_know_t_refuses_to_start_naming_the_key():
    with pytest.raises(ConfigError, match="learner.loss_scale_tokens"):
        load_config(LearnerConfig, overrides={"aggregation": "seq-mean-token-sum-norm"}, environ={})
    assert LearnerConfig(aggregation="seq-mean-token-sum-norm", batch={"max_completion_tokens": 12}).loss_scale == 12
    assert LearnerConfig(aggregation="seq-mean-token-sum-norm", loss_scale_tokens=7).loss_scale == 7
    assert LearnerConfig().loss_scale == 0  # token-mean needs no T


def test_a_sequence_that_could_never_fit_a_micro_batch_is_refused_before_start_naming_the_fix():
    """prompt + generation budget above micro_batch_tokens: such a sample would be a micro-batch of its own,
    beyond the learner's memory bound; the learner refuses to start and says what to raise."""
    long = {"max_prompt_tokens": 1024, "max_completion_tokens": 8192}
    with pytest.raises(ConfigError, match=r"= 9216 tokens.*raise learner.compute.micro_batch_tokens to 9216"):
        load_config(LearnerConfig, overrides={"batch": long}, environ={})
    assert LearnerConfig(batch=long, compute={"micro_batch_tokens": 9216}).batch.max_completion_tokens == 8192
    assert LearnerConfig(batch={"max_prompt_tokens": 100_000}).compute.micro_batch_tokens == 8192  # budget unknown
    # the prompts unknown (a run recorded before them, resumed: deploy/launcher/resume.py): not refused
    assert LearnerConfig(batch={"max_completion_tokens": 100_000}).loss_scale == 100_000
    # or split the sequence over ranks: each of k holds ⌈9216 / k⌉ tokens
    with pytest.raises(
        ConfigError, match=r"or split each sequence over ranks with learner.compute.sequence_parallel = 2"
    ):
        load_config(LearnerConfig, overrides={"batch": long}, environ={})
    assert LearnerConfig(batch=long, compute={"sequence_parallel": 2}).compute.micro_batch_tokens == 8192
    with pytest.raises(ConfigError, match=r"4608 tokens per rank over learner.compute.sequence_parallel = 2.*to 4608"):
        load_config(
            LearnerConfig,
            overrides={"batch": long, "compute": {"sequence_parallel": 2, "micro_batch_tokens": 4096}},
            environ={},
        )


def test_sequence_parallelism_refuses_a_critic_and_keeps_the_old_spelling():
    with pytest.raises(ConfigError, match="sequence_parallel = 2 with learner.critic.enabled"):
        load_config(
            LearnerConfig,
            overrides={"compute": {"sequence_parallel": 2}, "critic": {"enabled": True}},
            environ={},
        )
    # the spelling, learner.sequence_parallel, is the section's key (with a warning)
    assert load_config(LearnerConfig, overrides={"sequence_parallel": 2}, environ={}).compute.sequence_parallel == 2
