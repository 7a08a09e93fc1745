"""``relay up``'s live progress line and its once-only truncation warning.

In a terminal the line redraws in place with a bar; otherwise (a log file, CI) it is printed as a
plain line every 15 s. The line, once the first step is trained:

    step 12/16  75% [###############-----]  elapsed 13m02s  eta 4m20s  0.92 steps/min  212 tok/s
    reward 0.309  loss 0.0114  len 31/50 cut 2%  eval pass@1 0.41 (v8)  queue 8  gen-0:v12

(one line on screen). Before it, what the run is waiting for: the learner's first version, or the
first batch. Rates are measured from the first step this process saw (a resumed run's earlier
part does not count). What went wrong since the start follows, when anything did: samples whose
reward failed, by plugin (``reward-failed raises 640``), groups the learner dropped because every
reward of theirs failed (``reward-dropped 80``), and the policy problems relay up warned about
(``POLICY COLLAPSED``, deploy/launcher/alerts.py).
"""

from __future__ import annotations

import sys
import time


def duration(seconds: float) -> str:
    """65 -> '1m05s', 3725 -> '1h02m', 9 -> '9s'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def bar(done: int, total: int, width: int = 20) -> str:
    filled = min(width, int(width * done / total)) if total else 0
    return "[" + "#" * filled + "-" * (width - filled) + "]"


class Rates:
    """Steps and trained completion tokens per second since the first step seen."""

    def __init__(self):
        self.first: tuple[float, int, float] | None = None  # (time, step, tokens_trained)

    def update(self, now: float, step: int, tokens: float) -> tuple[float | None, float | None]:
        if step <= 0:
            return None, None
        if self.first is None or step < self.first[1]:
            self.first = (now, step, tokens)
            return None, None
        t0, s0, k0 = self.first
        if step == s0 or now <= t0:
            return None, None
        return (step - s0) / (now - t0), (tokens - k0) / (now - t0)


def failure_parts(st: dict) -> list[str]:
    """The progress line's failures: samples whose reward failed, by plugin, and groups dropped for them."""
    f = st.get("failures") or {}
    by_plugin = {k: int(v) for k, v in (f.get("reward_failures_by_plugin") or {}).items() if v}
    parts = ["reward-failed " + ", ".join(f"{k} {v}" for k, v in sorted(by_plugin.items()))] if by_plugin else []
    dropped = int((st.get("learner") or {}).get("groups_dropped_reward_failed", 0))
    if dropped:
        parts.append(f"reward-dropped {dropped}")
    return parts


def progress_line(
    st: dict,
    total: int,
    elapsed: float,
    steps_per_s: float | None,
    tokens_per_s: float | None,
    latest_eval: dict | None = None,
    restarts: int = 0,
    tty: bool = False,
    flags: list[str] | tuple = (),
) -> str:
    """One line of the run's state (``st``: the dashboard's ``/api/state``, broker/dashboard/state.py)."""
    ln = st.get("learner", {})
    step = int(ln.get("step", 0))
    gens = " ".join(
        f"{g['id']}:v{g['version'] if g.get('version') is not None else '-'}" for g in st.get("generators", [])
    )
    parts = [f"step {step}/{total}"]
    if tty:
        parts.append(f"{step / total:.0%} {bar(step, total)}" if total else "")
    parts.append(f"elapsed {duration(elapsed)}")
    if st.get("learner_version") is None:
        parts.append("waiting for the learner's first version (model load)")
    elif step == 0:
        scored = sum(int(g.get("reward_ok") or 0) for g in st.get("generators", []))
        failed = int((st.get("failures") or {}).get("reward_failures") or 0)
        parts.append(
            "waiting for the first batch: every reward so far failed"
            if failed and not scored
            else "waiting for the first batch (generation, rewards)"
        )
    else:
        if steps_per_s:
            rate = f"{steps_per_s:.1f} steps/s" if steps_per_s >= 1 else f"{steps_per_s * 60:.2f} steps/min"
            parts.append(f"eta {duration((total - step) / steps_per_s)}  {rate}")
        if tokens_per_s:
            parts.append(f"{tokens_per_s:.0f} tok/s")
        parts.append(f"reward {ln['reward_mean']:.3f}" if "reward_mean" in ln else "")
        parts.append(f"loss {ln['loss']:.4g}" if "loss" in ln else "")
        if "completion_truncated_frac" in ln:
            parts.append(
                f"len {ln['completion_len_mean']:.0f}/{ln['completion_len_max']:.0f} "
                f"cut {ln['completion_truncated_frac']:.0%}"
            )
    if latest_eval and latest_eval.get("pass@1") is not None:
        parts.append(f"eval pass@1 {latest_eval['pass@1']:.2f} (v{latest_eval['version']})")
    parts.append(f"queue {st.get('queue_depth', 0)}")
    dropped = int(ln.get("groups_dropped_stale", 0))
    if dropped:
        parts.append(f"stale-dropped {dropped}")
    if gens:
        parts.append(gens)
    if restarts:
        parts.append(f"restarts {restarts}")
    parts += failure_parts(st) + list(flags)
    return "  ".join(p for p in parts if p)


def latest_eval(rounds: list[dict]) -> dict | None:
    """The newest evaluation round that has a pass@1 (summary.json's ``eval`` entries)."""
    done = [x for x in rounds if x.get("pass@1") is not None]
    return max(done, key=lambda x: x["version"]) if done else None


class Progress:
    """Prints :func:`progress_line`: redrawn in place in a terminal, every 15 s otherwise."""

    def __init__(self, enabled: bool, total_steps: int, tty: bool | None = None):
        self.enabled = enabled
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.total = total_steps
        self.t0 = time.monotonic()
        self.rates = Rates()
        self.last_print = float("-inf")
        self.on_line = False

    def show(self, st: dict, restarts: int = 0, latest_eval: dict | None = None, flags: list[str] | tuple = ()) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        ln = st.get("learner", {})
        steps_s, tokens_s = self.rates.update(now, int(ln.get("step", 0)), float(ln.get("tokens_trained", 0)))
        line = progress_line(st, self.total, now - self.t0, steps_s, tokens_s, latest_eval, restarts, self.tty, flags)
        if self.tty:
            print("\r\033[K" + line, end="", flush=True)
            self.on_line = True
        elif now - self.last_print >= 15:
            print(line, flush=True)
            self.last_print = now

    def done(self) -> None:
        """End the line being redrawn, so that what is printed next starts on its own line."""
        if self.enabled and self.tty and self.on_line:
            print()
            self.on_line = False


class TruncationWarning:
    """The learner's warning that most completions stop at max_tokens (``truncated_warning_frac`` in
    its stats, learner/trainer.py), printed once on its own line (docs/datasets.md)."""

    def __init__(self, progress: Progress, max_tokens: int | None):
        self.progress, self.max_tokens, self.shown = progress, max_tokens, False

    def check(self, learner: dict, policy: str | None = None) -> None:
        """``policy``: what is wrong with the policy, when something is (deploy/launcher/alerts.py,
        ``PolicyWatch.suspect``): then the completions run to max_tokens because the policy answers noise,
        and the warning says so instead of blaming the budget."""
        frac = learner.get("truncated_warning_frac")
        if self.shown or frac is None:
            return
        self.shown = True
        self.progress.done()  # off the progress line
        setting = f" = {self.max_tokens}" if self.max_tokens else f" (default {_default_max_tokens()})"
        cut = (
            f"{frac:.0%} of the completions of the last steps stopped at max_tokens (mean length "
            f"{learner.get('completion_len_mean', 0):.1f} tokens at step {int(learner.get('step', 0))})"
        )
        if policy:
            print(
                f"relay up: warning: {cut}, but the budget is not what is wrong: the policy is broken ({policy}); "
                f"fix that rather than raising generator.sampling.max_tokens{setting}",
                flush=True,
            )
            return
        print(
            f"relay up: warning: {cut}: answers are cut off; raise generator.sampling.max_tokens{setting} "
            f"(docs/datasets.md)",
            flush=True,
        )


def _default_max_tokens() -> int:
    from generators.config import SamplingConfig

    return SamplingConfig.model_fields["max_tokens"].default
