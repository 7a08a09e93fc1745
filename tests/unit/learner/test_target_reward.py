"""``learner.target_reward``: the run ends after the first step at which the mean reward of the last
``target_window`` trained groups reaches the target, never before the window is full."""

from collections import deque
from types import SimpleNamespace

from learner.config import LearnerConfig
from learner.trainer import Learner


def learner(target, window):
    cfg = LearnerConfig(target_reward=target, target_window=window, steps=100)
    return SimpleNamespace(cfg=cfg, recent_rewards=deque(maxlen=window), target_reached=None)


def test_the_run_ends_at_the_first_step_whose_window_mean_reaches_the_target():
    ln = learner(0.9, 4)
    Learner.check_target(ln, [1.0, 1.0, 1.0], 1)  # above the target, but the window is not full
    assert ln.target_reached is None
    Learner.check_target(ln, [0.5, 1.0], 2)  # window 1, 1, 0.5, 1: 0.875
    assert ln.target_reached is None
    Learner.check_target(ln, [1.0, 0.9], 3)  # window 0.5, 1, 1, 0.9: 0.85
    assert ln.target_reached is None
    Learner.check_target(ln, [1.0], 4)  # window 1, 1, 0.9, 1: 0.975
    assert ln.target_reached == "reached the target reward 0.9 (mean 0.975 of the last 4 groups) at step 4 of 100"


def test_without_a_target_nothing_ends_the_run_or_is_kept():
    ln = learner(None, 4)
    Learner.check_target(ln, [1.0] * 8, 1)
    assert ln.target_reached is None and not ln.recent_rewards
