"""``learner.target.reward``: the run ends after the first step at which the mean reward of the last
``target_window`` trained groups reaches the target, never before the window is full."""

from learner.target import TargetReward


def learner(target, window):
    return TargetReward(target, window, steps=100)


def test_the_run_ends_at_the_first_step_whose_window_mean_reaches_the_target():
    ln = learner(0.9, 4)
    ln.check([1.0, 1.0, 1.0], 1)  # above the target, but the window is not full
    assert ln.reached is None
    ln.check([0.5, 1.0], 2)  # window 1, 1, 0.5, 1: 0.875
    assert ln.reached is None
    ln.check([1.0, 0.9], 3)  # window 0.5, 1, 1, 0.9: 0.85
    assert ln.reached is None
    ln.check([1.0], 4)  # window 1, 1, 0.9, 1: 0.975
    assert ln.reached == "reached the target reward 0.9 (mean 0.975 of the last 4 groups) at step 4 of 100"


def test_without_a_target_nothing_ends_the_run_or_is_kept():
    ln = learner(None, 4)
    ln.check([1.0] * 8, 1)
    assert ln.reached is None and not ln.recent
