"""The learner's choice for samples whose reward failed: skip them (default) or train on a fallback score."""

import pytest
import torch

from learner.config import LearnerConfig
from learner.data import collate, group_mean_reward, trained_rewards
from tests.support.data import make_group


def test_skip_leaves_failed_samples_out_and_fallback_uses_the_score():
    g = make_group()  # sample 0: reward 1.0 ok; sample 1: failed
    assert [s.reward_status for s in g.samples] == ["ok", "failed"]
    assert trained_rewards(g) == [1.0, None]
    assert trained_rewards(g, "fallback", -0.5) == [1.0, -0.5]

    skip = collate([g], [torch.tensor([0.0])], learner_version=4, pad_id=0)
    assert skip.input_ids.shape[0] == 1 and group_mean_reward(g) == 1.0
    fb = collate(
        [g], [torch.tensor([0.7, -0.7])], learner_version=4, pad_id=0, failed_reward="fallback", fallback_score=-0.5
    )
    assert fb.input_ids.shape[0] == 2 and group_mean_reward(g, "fallback", -0.5) == pytest.approx(0.25)
    assert fb.advantages[:, 0].tolist() == pytest.approx([0.7, -0.7])
    # the failed sample's completion is trained on: its tokens are in the loss mask
    assert fb.loss_mask[1].sum() == len(g.samples[1].completion_ids)


def test_learner_config_validates_the_choice():
    assert LearnerConfig().batch.failed_reward == "skip"
    assert LearnerConfig(batch={"failed_reward": "fallback", "fallback_score": 0.0}).batch.fallback_score == 0.0
    with pytest.raises(ValueError, match="failed_reward"):
        LearnerConfig(batch={"failed_reward": "zero"})
