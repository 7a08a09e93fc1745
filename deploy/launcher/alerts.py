"""``relay up``'s console warnings about what goes wrong after start-up, and the failures that stop a run.

The loop hands :class:`ConsoleAlerts` the run's state (the dashboard's ``/api/state``,
broker/dashboard/state.py) once a second. It reads the learner's per-step metrics itself, as they come
(:class:`LearnerEntries`), and prints each new problem once, on its own line, as ``relay up: warning:
...``; the lines are kept for ``summary.json`` (``warnings``) and the final report:

- reward failures, by plugin, with the plugin's own reason (the generators' heartbeats:
  ``reward_failures_by_plugin``, ``reward_last_failure``): a plugin that raises, a remote server
  answering 401 or garbage, the reward service unreachable (``reward_service``), an environment whose
  episodes fail (``env:<name>``). A new reason code of a plugin is said again.
- a policy that stopped learning (:class:`PolicyWatch`): most of the last ``POLICY_WINDOW`` steps
  without a gradient (every sample of each group got the same reward, so the loss and its gradient are
  0), a collapse when the entropy is near 0 too and the reward no longer rises; a dead policy (no gradient while the loss is not 0: its
  outputs no longer depend on its weights, as a far too high learning rate leaves it); a policy
  diverging: its gradient norm ``EXPLODE_FACTOR`` times its norm at the start, or optimizer steps skipped
  for a non-finite loss or gradient.

A failure that keeps happening stops the run (:class:`RunFailure`, its reason printed last, as a
start-up error is): no reward was scored for ``fail_after_s`` seconds (``relay up --fail-after``,
default 120; 0 = never) while failed ones kept arriving. A service that keeps dying for one reason is
the supervisor's (deploy/launcher/supervisor.py).

Pure logic on dictionaries: :class:`RewardWatch` and :class:`PolicyWatch` are tested without a run.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterable

POLICY_WINDOW = 50  # steps in a row without a gradient before the policy is said to have stopped learning
NO_GRADIENT = 1e-8  # a gradient norm (or, where it is not known, a loss) at most this is none
DEAD_STEPS = 5  # steps in a row without a gradient though the loss is not 0 before the policy is said dead
COLLAPSE_FLAT = 0.5  # share of a window's steps without a gradient that, at an entropy near 0, is a collapse
STALL_FLAT = 0.9  # share of a window's steps without a gradient that is no learning signal (or convergence)
STALL_REARM = 0.2  # a stall is said again only after the steps without a gradient fell below this share
REWARD_RISING = 0.02  # the window's second half this much above its first: still learning, not collapsed
CONVERGED_SHARE = 0.99  # a stalled window's mean reward this share of the best step's or more: converged
COLLAPSE_ENTROPY = 0.05  # nats per token: below it the policy answers one way (a collapse, not a flat reward)
EXPLODE_FACTOR = 100.0  # the recent gradient norm this many times the start's: diverging
EXPLODE_BASELINE = 20  # steps whose gradient norms are the start's
EXPLODE_RECENT = 10  # steps whose median gradient norm is the recent one


class RunFailure(Exception):
    """A failure that keeps happening: the run stops, and this message is its error (printed last)."""


def _code(reason: str) -> str:
    return reason.split(":", 1)[0].strip()


def describe_failures(plugin: str, n: int, reason: str, logs: Path | None = None) -> str:
    """One sentence: who failed (a reward plugin, the reward service itself, an environment), how many
    samples, and the last reason; ``logs``: the run's log folder, named as the place to look."""
    where = lambda name: f" ({logs / name})" if logs is not None else ""  # noqa: E731
    said = f": {reason}" if reason else ""
    if plugin == "reward_service":
        return f"the generators got no reward from the reward service for {n} samples{said}{where('gen-*.log')}"
    if plugin.startswith("env:"):
        return f"environment '{plugin[4:]}' failed {n} episodes{said}{where('gen-*.log')}"
    return f"reward plugin '{plugin}' failed {n} samples{said}{where('reward.log')}"


class RewardWatch:
    """The generators' reward counters (summed over their heartbeats, a restarted generator's counting
    from 0 again): what is new to say, and whether no reward has been scored for ``fail_after_s``."""

    def __init__(self, fail_after_s: float, logs: Path | None = None):
        self.fail_after_s, self.logs = fail_after_s, logs
        self.ok = self.failed = 0  # totals over the run, restarts included
        self._last: dict[str, tuple[int, int]] = {}  # generator id -> its (reward_ok, reward_failures) last seen
        self.by_plugin: dict[str, int] = {}
        self.reasons: dict[str, str] = {}  # plugin -> its latest reason
        self._said: set[tuple[str, str]] = set()  # (plugin, reason code) already printed
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, ok, failed), the last fail_after_s
        self.streak: tuple[float, int] | None = None  # (time, failed before it): failures since, nothing scored

    def update(self, st: dict, now: float) -> list[str]:
        """Take the state ``st`` at time ``now``; the warnings to print (each plugin's new reason)."""
        ok_before, failed_before = self.ok, self.failed
        for g in st.get("generators") or []:
            ok, failed = int(g.get("reward_ok") or 0), int(g.get("reward_failures") or 0)
            last_ok, last_failed = self._last.get(g["id"], (0, 0))
            if ok < last_ok or failed < last_failed:  # a restarted generator counts from 0
                last_ok, last_failed = 0, 0
            self.ok += ok - last_ok
            self.failed += failed - last_failed
            self._last[g["id"]] = (ok, failed)
        f = st.get("failures") or {}
        self.by_plugin = {k: int(v) for k, v in (f.get("reward_failures_by_plugin") or {}).items() if v}
        self.reasons.update(f.get("reward_last_failure") or {})
        if self.ok > ok_before:
            self.streak = None  # a reward was scored: no streak of failures only
        elif self.failed > failed_before and self.streak is None:
            self.streak = (now, failed_before)  # the first failures with nothing scored since
        self._samples.append((now, self.ok, self.failed))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.fail_after_s:
            self._samples.popleft()  # keep one sample at least fail_after_s old
        out = []
        for plugin, n in sorted(self.by_plugin.items()):
            reason = self.reasons.get(plugin, "")
            if (plugin, _code(reason)) not in self._said:
                self._said.add((plugin, _code(reason)))
                out.append(describe_failures(plugin, n, reason, self.logs))
        return out

    def stop_reason(self, now: float) -> str | None:
        """Why the run must stop: for ``fail_after_s`` since the first failure no reward was scored while
        failures kept arriving (some in the last half of that time too); None otherwise, or with
        ``fail_after_s`` 0. (Before the first failure, a model loading scores nothing either: not counted.)"""
        if not self.fail_after_s or self.streak is None:
            return None
        t0, failed0 = self.streak
        if now - t0 < self.fail_after_s:
            return None
        half = next((s for s in self._samples if s[0] >= now - self.fail_after_s / 2), None)
        if half is None or self.failed == half[2]:
            return None  # nothing failed lately: held by an outage, or the run is idle
        worst = max(self.by_plugin, key=self.by_plugin.get) if self.by_plugin else ""
        who = (
            describe_failures(worst, self.by_plugin.get(worst, 0), self.reasons.get(worst, ""), self.logs)
            if worst
            else "failed rewards"
        )
        return (
            f"no reward was scored for {now - t0:.0f}s while {self.failed - failed0} failed; {who}. Fix that, "
            f"or give --fail-after 0 to let a run go on without rewards"
        )


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


class PolicyWatch:
    """The learner's per-step metrics (``entropy``, ``loss``, ``grad_norm``, ``reward_mean``, ``lr``,
    ``skipped_steps``): warnings when the policy stops learning or is destroyed, each said once until it
    recovers.

    - over a window of ``POLICY_WINDOW`` steps: collapsed (entropy near 0, at least ``COLLAPSE_FLAT`` of the
      steps without any gradient: every sample of each group got the same reward, and the reward not
      rising), converged (the same, at the best reward a step of the run had: a note), no learning signal (entropy high,
      ``STALL_FLAT`` of the steps without a gradient);
    - a dead policy: no gradient while the loss is not 0, ``DEAD_STEPS`` steps in a row (the model's
      outputs no longer depend on its weights: what a far too high learning rate leaves);
    - diverging: the gradient norm ``EXPLODE_FACTOR`` times its norm at the start, or optimizer steps
      skipped for a non-finite loss or gradient."""

    def __init__(self, window: int = POLICY_WINDOW):
        self.recent: deque[dict] = deque(maxlen=window)
        self.baseline: list[float] = []  # the first EXPLODE_BASELINE finite gradient norms
        self.norms: deque[float] = deque(maxlen=EXPLODE_RECENT)
        self.skipped = 0
        self.dead = 0  # consecutive steps without a gradient while the loss is not 0
        self.stalled = self.diverging = False  # said, until it recovers
        self.collapsed = False  # the stall is a collapse (entropy near 0), not a flat reward
        self.converged = False  # the stall is every prompt at the run's best reward (a note, not a warning)
        self.killed = False  # said: the policy is dead
        self.best = float("-inf")  # the highest reward_mean of a step so far
        self.notes: list[str] = []  # said as notes, not warnings: a policy that converged at its best

    @staticmethod
    def _kind(e: dict) -> str:
        """``learning``, ``flat`` (no gradient, loss 0) or ``dead`` (no gradient, a loss that is not 0)."""
        norm, loss = _num(e.get("grad_norm")), _num(e.get("loss"))
        if norm is not None and norm > NO_GRADIENT:
            return "learning"
        if loss is not None and abs(loss) <= NO_GRADIENT:
            return "flat" if norm is not None or loss is not None else "learning"
        return "dead" if norm is not None and loss is not None else "learning"

    def update(self, entries: Iterable[dict]) -> list[str]:
        out = []
        for e in entries:
            self.recent.append(e)
            norm = _num(e.get("grad_norm"))
            if norm is not None:
                if len(self.baseline) < EXPLODE_BASELINE:
                    self.baseline.append(norm)
                self.norms.append(norm)
            reward = _num(e.get("reward_mean"))
            self.best = max(self.best, reward) if reward is not None else self.best
            self.dead = self.dead + 1 if self._kind(e) == "dead" else 0
            out += self._stalled(e) + self._dead(e) + self._diverging(e)
        return out

    def suspect(self) -> str | None:
        """What is wrong with the policy now, in a few words (None: nothing seen), for a warning that would
        otherwise blame something else (the truncation warning blames max_tokens)."""
        last = self.recent[-1] if self.recent else {}
        if self.dead >= 2:
            return (
                f"its gradient has been 0 for the last {self.dead} steps while its loss is not (entropy "
                f"{_fmt(last.get('entropy'))}): the model no longer responds to its weights"
            )
        if self.skipped:
            return f"{self.skipped} optimizer step(s) were skipped for a non-finite loss or gradient"
        if self.diverging:
            return (
                f"its gradient norm is {statistics.median(self.norms):.3g}, {EXPLODE_FACTOR:.0f}x its norm at "
                f"the start or more"
            )
        return None

    def _stalled(self, e: dict) -> list[str]:
        """A full window in which most steps had no gradient (``flat``: every sample of each group got the same
        reward). With the entropy near 0 and the reward no longer rising: collapsed (half the steps flat are
        enough: a measured default run at entropy 0.005 had 105 of its 600 steps flat, never 50 in a row,
        and its reward stuck at 0.88 while single steps had reached 0.97); the same at the best reward a
        step of the run had: converged (a note); with the entropy high: no learning signal (nearly every
        step flat). Said once, until the flat steps are few
        again."""
        flat = sum(self._kind(r) == "flat" for r in self.recent)
        if self.stalled and flat < self.recent.maxlen * STALL_REARM:
            self.stalled = self.collapsed = self.converged = False
        if self.stalled or len(self.recent) < self.recent.maxlen:
            return []
        ents = [x for x in (_num(r.get("entropy")) for r in self.recent) if x is not None]
        rewards = [x for x in (_num(r.get("reward_mean")) for r in self.recent) if x is not None]
        ent = statistics.median(ents) if ents else None  # the window's typical step, whatever a few others did
        n, step = len(self.recent), int(_num(e.get("step")) or 0)
        half = len(rewards) // 2
        rising = half and statistics.fmean(rewards[half:]) > statistics.fmean(rewards[:half]) + REWARD_RISING
        low = ent is not None and ent < COLLAPSE_ENTROPY
        if (
            low
            and rewards
            and flat >= n * COLLAPSE_FLAT
            and self.best > 0
            and statistics.fmean(rewards) >= CONVERGED_SHARE * self.best
        ):
            self.stalled = self.converged = True  # at the best reward a step of the run had: solved, not stuck
            self.notes.append(
                f"the policy converged: over the last {n} steps (to step {step}) its entropy was "
                f"{ent:.3g} and {flat} steps had no gradient, at a mean reward of "
                f"{statistics.fmean(rewards):.3f}, the best of the run: more steps change little "
                f"(learner.target.reward ends a run there)"
            )
            return []
        reward = f"{statistics.fmean(rewards):.3f}" if rewards else "-"
        if low and flat >= n * COLLAPSE_FLAT and not rising:
            self.stalled = self.collapsed = True
            return [
                f"the policy has collapsed: over the last {n} steps (to step {step}) its entropy was {ent:.3g} "
                f"and {flat} steps had no gradient at all (every sample of each group got the same reward), and "
                f"the mean reward stays at {reward}: it gives one answer per prompt and learns nothing more. "
                f"If {reward} is the task's best score the run has converged (learner.target.reward ends a run "
                f"there); otherwise raise learner.regularization.entropy_coef or generator.sampling.temperature, or lower "
                f"learner.optim.lr (docs/learner.md)"
            ]
        if not low and flat >= n * STALL_FLAT:
            self.stalled = True
            return [
                f"no learning signal: over the last {n} steps (to step {step}) {flat} had no gradient at all "
                f"(every sample of each group got the same reward; mean {reward}); check that the reward can "
                f"tell answers apart (its plugin, the dataset's references)"
            ]
        return []

    def _dead(self, e: dict) -> list[str]:
        if self.dead == 0:
            self.killed = False
            return []
        if self.killed or self.dead < DEAD_STEPS:
            return []
        self.killed = True
        return [
            f"the policy is dead: its gradient has been 0 for the last {self.dead} steps (to step "
            f"{int(_num(e.get('step')) or 0)}) while its loss is {_fmt(e.get('loss'))} and its entropy "
            f"{_fmt(e.get('entropy'))}, so its outputs no longer depend on its weights and nothing more is "
            f"learnt; a learning rate far too high does this (learner.optim.lr = {_fmt(e.get('lr'))}): lower it and "
            f"start again"
        ]

    def _diverging(self, e: dict) -> list[str]:
        out = []
        skipped = int(_num(e.get("skipped_steps")) or 0)
        if skipped > self.skipped:
            if not self.skipped:
                out.append(
                    f"{skipped} optimizer step(s) skipped by step {int(_num(e.get('step')) or 0)} for a "
                    f"non-finite loss or gradient (the weights were left as they were; the learner's log "
                    f"says which): the policy is diverging, lower learner.optim.lr ({_fmt(e.get('lr'))})"
                )
            self.skipped = skipped
        if len(self.baseline) < EXPLODE_BASELINE or len(self.norms) < EXPLODE_RECENT:
            return out
        base, now = statistics.median(self.baseline), statistics.median(self.norms)
        if base <= NO_GRADIENT or now < EXPLODE_FACTOR * base:
            self.diverging = self.diverging and now >= EXPLODE_FACTOR * base / 10  # recovered below 10x
            return out
        if not self.diverging:
            self.diverging = True
            out.append(
                f"the policy may be diverging: its gradient norm is {now:.3g} (median of the last "
                f"{len(self.norms)} steps, to step {int(_num(e.get('step')) or 0)}), {now / base:.0f}x its "
                f"{base:.3g} at the start (entropy {_fmt(e.get('entropy'))}): lower learner.optim.lr "
                f"({_fmt(e.get('lr'))})"
            )
        return out


def _fmt(x) -> str:
    v = _num(x)
    return "-" if v is None else f"{v:.4g}"


class LearnerEntries:
    """The learner's per-step metrics from its Redis stream (``learner_metrics``), each entry once."""

    def __init__(self, r, keys):
        self.r, self.keys, self.after = r, keys, None

    def new(self) -> list[dict]:
        from broker.dashboard.state import learner_history

        entries = learner_history(self.r, self.keys, self.after, 2000)
        if entries:
            self.after = entries[-1]["id"]
        return [e for e in entries if "error" not in e]


class ConsoleAlerts:
    """The warnings ``relay up`` prints while a run goes (the module's docstring), and the stop."""

    def __init__(
        self,
        before_print: Callable[[], None],
        fail_after_s: float,
        logs: Path | None = None,
        entries: Callable[[], list[dict]] = lambda: [],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.before_print, self.entries, self.clock = before_print, entries, clock
        self.reward = RewardWatch(fail_after_s, logs)
        self.policy = PolicyWatch()
        self.warnings: list[str] = []  # every warning printed, in order (summary.json's "warnings")

    def check(self, st: dict) -> None:
        """Print what is new in ``st`` (and the learner's new steps); RunFailure when the run must stop."""
        now = self.clock()
        for text in self.reward.update(st, now) + self.policy.update(self.entries()):
            self.warn(text)
        while self.policy.notes:
            self.before_print()
            print(f"relay up: note: {self.policy.notes.pop(0)}", flush=True)
        why = self.reward.stop_reason(now)
        if why:
            raise RunFailure(why)

    def warn(self, text: str) -> None:
        self.before_print()  # off the progress line
        print(f"relay up: warning: {text}", flush=True)
        self.warnings.append(text)

    def flags(self) -> list[str]:
        """Short words for the progress line while a policy problem lasts."""
        out = []
        if self.policy.killed:
            out.append("POLICY DEAD")
        if self.policy.stalled:
            out.append(
                "POLICY COLLAPSED"
                if self.policy.collapsed
                else "CONVERGED"
                if self.policy.converged
                else "NO LEARNING SIGNAL"
            )
        if self.policy.diverging:
            out.append("POLICY DIVERGING")
        return out
