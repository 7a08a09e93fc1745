"""Exactly-once training: checkpoints and the commits of the groups they hold (learner/trainer.py's loop).

A group read from the queue stays pending until the leader commits it (acknowledged, and recorded once in
the audit log). With checkpoints (``learner.publish.checkpoint_every``) a group is committed only once a checkpoint
holds the weights trained on it: a learner killed in between resumes from the checkpoint, and the groups
still pending are read and trained again from its weights. Without checkpoints each step commits its own.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from broker.client import queues
from broker.protocol.keys import Keys
from learner import checkpoint
from learner.config import LearnerConfig
from learner.observe import finite_metrics
from learner.steplog import StepLog
from learner.versions import Versions

log = logging.getLogger("relay.learner")


class ExactlyOnce:
    """The checkpoints of the ``engine`` (and the ``critic``) with where the ``versions`` stand and the
    ``counts``, and the leader's commits; ``steplog``: the leader's step log (None on the other ranks)."""

    def __init__(
        self,
        cfg: LearnerConfig,
        r,
        keys: Keys,
        engine,
        critic,
        versions: Versions,
        counts: Counter,
        steplog: StepLog | None,
    ):
        self.cfg, self.r, self.keys = cfg, r, keys
        self.engine, self.critic, self.versions, self.counts, self.steplog = engine, critic, versions, counts, steplog
        self.leader = steplog is not None
        self.saved_step = 0  # the step of the newest checkpoint
        self.step_metrics: dict | None = None  # the leader's metrics line of the step just trained
        self.uncommitted: list[tuple[str, str]] = []  # (stream id, group id) trained since the last checkpoint

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.cfg.run_dir) / "checkpoints"

    def resume(self, agree) -> int:
        """Continue from the newest checkpoint: weights, optimizer, counters and versions (``agree``: the
        leader's decision on every rank); the groups it holds are committed (idempotently), the rest of
        this learner's pending groups are re-read and trained again from the checkpoint's weights. The
        checkpoint's step (0 without one)."""
        if not self.cfg.publish.checkpoint_every:
            return 0
        # every rank: the weights and its optimizer partition, the critic's too
        state = checkpoint.load(self.ckpt_dir, self.engine, self.critic)
        if state is None:
            return 0
        step = self.saved_step = state["step"]
        self.counts.update(state["counts"])
        self.versions.resumed(state, agree)  # the leader's decision, on every rank
        if not self.leader:
            return step
        self.commit([tuple(x) for x in state["uncommitted"]], step)
        self.steplog.keep_through(step, state.get("metrics"))  # steps after the checkpoint are redone
        log.info("resumed from checkpoint at step %d (%d groups committed with it)", step, len(state["uncommitted"]))
        return step

    def commit(self, entries: list[tuple[str, str]], step: int) -> None:
        """Acknowledge trained groups and record them once each in the audit log."""
        queues.commit(self.r, self.keys, entries, step, self.cfg.batch.record_window)

    def commit_trained(self, step: int) -> None:
        """The leader commits every group trained since the last commit."""
        self.commit(self.uncommitted, step)
        self.uncommitted = []

    def after_step(self, step: int, fresh, publishes: bool) -> None:
        """On every rank (each writes its part of a checkpoint); the leader, which read ``fresh``,
        then commits what the checkpoint holds, or commits every step without checkpoints.
        ``publishes``: this step's weights are published right after."""
        every = self.cfg.publish.checkpoint_every
        due = (step % every == 0 or step == self.cfg.steps) if every else True
        if self.leader:
            self.uncommitted.extend((eid.decode(), g.group_id) for eid, g in fresh)
        if every and due:
            self.checkpoint(step, publishes)
        elif self.leader and due:
            self.commit_trained(step)

    def checkpoint(self, step: int, publishes: bool = False) -> None:
        """Write a checkpoint of ``step`` (every rank), then commit what it holds (the leader). It also
        holds the step's metrics line: a learner killed after the checkpoint and before writing that
        line gets it back on resume (metrics.jsonl has one line per step, whatever the crash), and where
        the versions stand (``pending``: its weights are published right after it, as the next version;
        ``unpublished``: they differ from the last version's), so that a resumed learner continues the
        versions without publishing the same weights again (learner/publish.py ``resumed_versions``)."""
        self.versions.drain()  # the checkpoint records a version: announced (or skipped) before it is written
        where = self.versions.checkpoint_state(publishes)
        line = None
        if self.leader and self.step_metrics is not None and self.step_metrics.get("step") == step:
            line = dict(self.step_metrics)
            if "version" not in line:  # the checkpoint comes before this step's publication
                line["version"] = where["version"] + int(where["pending"])
            line = finite_metrics(line)
        checkpoint.save(
            self.ckpt_dir,
            step,
            self.engine,
            {**where, "counts": dict(self.counts), "uncommitted": self.uncommitted, "metrics": line},
            critic=self.critic,
        )
        self.saved_step = step
        if self.leader:
            self.commit_trained(step)
