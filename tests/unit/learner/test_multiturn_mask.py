"""A multi-turn sample (docs/protocol.md 3.5) is trained on the tokens its model sampled only: the
context between its turns (a tool's output) is in the sequence, never in the loss."""

import numpy as np
import torch

from broker.protocol.group import Sample
from learner.advantages import gae
from learner.data import collate
from tests.support.data import make_group

# <tool_call> 7 * 8 </tool_call> <eos> | <tool_response> 5 6 </tool_response> | 5 6 <eos>
EPISODE = [16, 10, 15, 11, 17, 2, 18, 8, 9, 19, 8, 9, 2]
TRAINABLE = [1] * 6 + [0] * 4 + [1] * 3


def episode_group():
    lps = np.where(np.array(TRAINABLE) == 1, -0.5, 0.0).astype(np.float32)
    s = Sample(np.array(EPISODE, np.int32), lps, [[5, 6], [6, 7]], "stop", 1.0, trainable=np.array(TRAINABLE, np.uint8))
    single = Sample(np.array([8, 9, 2], np.int32), np.full(3, -0.5, np.float32), [[6, 3]], "stop", 0.0)
    return make_group(samples=[s, single], prompt_ids=np.array([1, 10, 15, 11, 14], np.int32))


def test_the_loss_mask_covers_exactly_the_model_tokens():
    b = collate([episode_group()], [torch.tensor([0.5, -0.5])], learner_version=6, pad_id=0)
    P = 5
    # position t predicts token t+1: the episode's tokens start at P - 1
    assert b.loss_mask[0, P - 1 : P - 1 + len(EPISODE)].tolist() == [float(t) for t in TRAINABLE]
    assert b.loss_mask[0].sum() == 9 and b.loss_mask[0, : P - 1].sum() == 0
    assert b.loss_mask[1, P - 1 : P + 2].tolist() == [1.0, 1.0, 1.0]  # a single-turn sample: every token
    # the context tokens are still in the sequence the model reads
    assert b.input_ids[0, : P + len(EPISODE)].tolist() == [1, 10, 15, 11, 14] + EPISODE
    assert b.staleness == [1, 0]  # the oldest version of any token


def test_gae_carries_the_outcome_across_the_context_between_turns():
    """With the reward on the last model token, every model token of both turns gets it (γ = λ = 1,
    V = 0), and the context tokens get nothing."""
    mask = torch.tensor([TRAINABLE], dtype=torch.float32)
    rewards = torch.zeros_like(mask)
    rewards[0, len(TRAINABLE) - 1] = 1.0
    adv, _ = gae(rewards, torch.zeros_like(mask), mask)
    assert (adv * mask).tolist()[0] == [float(t) for t in TRAINABLE]
