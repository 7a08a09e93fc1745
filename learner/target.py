"""``learner.target.reward``: a run that ends once its policy is good enough."""

from __future__ import annotations

from collections import deque


class TargetReward:
    """Once the mean reward of the last ``window`` trained groups reaches ``target``, the step that got there
    is the run's last (the leader takes no further batch; ``reached`` says why, the run's ``ended``).
    ``target`` None: nothing ends the run early and nothing is kept."""

    def __init__(self, target: float | None, window: int, steps: int):
        self.target, self.steps = target, steps
        self.recent: deque[float] = deque(maxlen=window)
        self.reached: str | None = None

    def check(self, rewards: list[float], step: int) -> None:
        if self.target is None:
            return
        self.recent.extend(rewards)
        if len(self.recent) < self.recent.maxlen:
            return
        mean = sum(self.recent) / len(self.recent)
        if mean >= self.target:
            self.reached = (
                f"reached the target reward {self.target:g} (mean {mean:.3f} of the last "
                f"{len(self.recent)} groups) at step {step} of {self.steps}"
            )
