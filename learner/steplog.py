"""The learner's step log: every output of a step's metrics written in one place (the leader's).

One line per step in ``run_dir/metrics.jsonl`` (strict JSON: a non-finite value becomes null and is counted),
the dashboard's Redis stream and ``/metrics`` (learner/observe.py), TensorBoard and W&B (learner/records.py),
and the learner's stats hash in Redis (``relay status``, the progress line). It also warns once when most
completions stop at ``max_tokens``.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from pathlib import Path

from broker.client.connection import redact_url
from broker.protocol.keys import Keys
from learner.config import LearnerConfig
from learner.observe import LearnerObserver, finite_metrics
from learner.records import RunRecords

log = logging.getLogger("relay.learner")

LENGTH_STATS = ("completion_len_mean", "completion_len_max", "completion_truncated_frac")
# more than this share of the completions of the last TRUNCATED_WARN_STEPS steps stopped at max_tokens:
# warn, once (a window, so a random-init model's long first answers do not set it off)
TRUNCATED_WARN_FRAC = 0.5
TRUNCATED_WARN_STEPS = 5


class StepLog:
    def __init__(self, r, keys: Keys, cfg: LearnerConfig):
        self.r, self.keys = r, keys
        self.path = Path(cfg.run_dir) / "metrics.jsonl"
        # /metrics, /healthz, per-step metrics stream
        self.observer = LearnerObserver(r, keys, cfg)
        # TensorBoard event files in run_dir/tensorboard (and W&B when enabled)
        shown = {**cfg.model_dump(), "redis_url": redact_url(cfg.redis_url)}  # the config W&B records: no password
        self.records = RunRecords(cfg.run_dir, cfg.metrics.tensorboard, cfg.metrics.wandb, cfg.run_id, shown)
        self.recent_truncated: deque[float] = deque(maxlen=TRUNCATED_WARN_STEPS)
        self.warned_truncated = False
        self.file = None

    def keep_through(self, step: int, saved_line: dict | None) -> None:
        """A resumed learner's log: the lines of the steps after its checkpoint are dropped (those steps are
        trained again), and the checkpoint's own line put back when the learner was killed after writing the
        checkpoint and before that line (metrics.jsonl keeps one line per step, whatever the crash)."""
        kept = (
            [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
            if self.path.is_file()
            else []
        )
        last = json.loads(kept[-1]).get("step", 0) if kept else 0
        if saved_line and last < step:
            kept.append(json.dumps(saved_line, allow_nan=False))
        self.path.write_text("".join(ln + "\n" for ln in kept))

    def open(self) -> None:
        self.file = open(self.path, "a")

    def write(self, diag: dict, counts: dict) -> dict:
        """One step's metrics line to every output; returns it as written (finite numbers or null)."""
        self.warn_if_truncated(diag)
        diag = finite_metrics(diag)  # strict JSON: a non-finite value becomes null, and is counted
        self.file.write(json.dumps(diag, allow_nan=False) + "\n")
        self.file.flush()
        self.observer.record(diag)
        self.records.log(diag)
        self.r.hset(
            self.keys.stats("learner"),
            mapping={
                "step": diag["step"],
                "version": diag["version"],
                **counts,
                **{k: diag[k] for k in ("reward_mean", "loss", *LENGTH_STATS) if diag[k] is not None},
            },
        )
        return diag

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.records.close()

    def warn_if_truncated(self, diag: dict) -> None:
        """Warn once when most completions of the last ``TRUNCATED_WARN_STEPS`` steps stopped at
        ``max_tokens``: their answers were cut off, and the reward and the gradient are of cut-off text
        (raise ``generator.sampling.max_tokens``). In the log, and as ``truncated_warning_frac`` in the
        learner's stats, which ``relay up`` prints once."""
        self.recent_truncated.append(diag["completion_truncated_frac"])
        frac = sum(self.recent_truncated) / len(self.recent_truncated)
        if self.warned_truncated or len(self.recent_truncated) < TRUNCATED_WARN_STEPS or frac <= TRUNCATED_WARN_FRAC:
            return
        self.warned_truncated = True
        self.r.hset(self.keys.stats("learner"), "truncated_warning_frac", frac)
        log.warning(
            "%.0f%% of the completions of the last %d steps stopped at max_tokens (mean length %.1f tokens "
            "at step %d): their answers are cut off; raise generator.sampling.max_tokens (docs/datasets.md)",
            100 * frac,
            TRUNCATED_WARN_STEPS,
            diag["completion_len_mean"],
            diag["step"],
        )
