"""The leader's intake: batches of trainable groups from the replay queue. What cannot be trained
(too stale, every reward failed, a token outside the vocabulary, another sampling transform, a reward,
log-prob or advantage that is not a finite float32, undecodable) is acknowledged, dropped and counted on the way, never silently."""

from __future__ import annotations

import logging
import threading
from collections import Counter

from broker.client import queues
from broker.protocol.group import sampling_transform
from broker.protocol.keys import Keys
from learner.advantages import GROUP_ESTIMATORS
from learner.config import LearnerConfig
from learner.data import nonfinite_reason, trained_rewards

log = logging.getLogger("relay.learner.intake")


class GroupIntake:
    def __init__(self, r, keys: Keys, cfg: LearnerConfig, vocab: int, counts: Counter):
        self.r, self.keys, self.cfg, self.vocab = r, keys, cfg, vocab
        self.counts = counts  # the learner's counters: drops are added under their reason
        # the finiteness check of a group's advantages: its own estimator, or for those over the batch or over
        # the critic's values (not defined on one group) grpo's, finite exactly when the rewards are
        self.advantage_fn = GROUP_ESTIMATORS.get(cfg.advantages.estimator, GROUP_ESTIMATORS["grpo"])
        self.reader = queues.TrajectoryReader(r, keys)
        self.data_ended = False  # set when a batch can no longer fill: the dataset is used up

    def out_of_data(self) -> bool:
        """The dataset is used up (the feeder fed its last epoch), every prompt fed has been answered
        and released (the prompts stream is empty), and every group they gave has been read: no
        further group can come."""
        return (
            self.reader.past_pending  # a restarted learner re-read its pending groups first
            and self.r.hget(self.keys.stats("broker"), "dataset_exhausted") == b"1"
            and queues.prompts_ready(self.r, self.keys) == 0
            and queues.waiting_groups(self.r, self.keys) == 0
        )

    def next_batch(self, version: int, stop: threading.Event):
        """``batch_groups`` trainable groups as (stream id, group) pairs for a learner at ``version``;
        None when asked to stop, or when the data ran out first (``data_ended`` then; the groups read
        for the unfinished batch stay in the queue, unacknowledged, and the audit counts them queued)."""
        fresh: list = []
        transform = None
        while len(fresh) < self.cfg.batch.groups:
            ended = False

            def should_stop() -> bool:
                nonlocal ended
                ended = ended or self.out_of_data()
                return stop.is_set() or ended

            entries = self.reader.wait_for(
                self.cfg.batch.groups - len(fresh), should_stop, self.cfg.batch.wait_timeout_s
            )
            if stop.is_set():
                return None
            if ended and not entries:
                self.data_ended = True
                return None
            drops = []  # (stream id, group id, reason)
            for eid, g in entries:
                if g is None:
                    why = "groups_undecodable"
                elif version - g.min_version > self.cfg.batch.max_staleness:
                    why = "groups_dropped_stale"
                elif all(
                    r is None for r in trained_rewards(g, self.cfg.batch.failed_reward, self.cfg.batch.fallback_score)
                ):
                    why = "groups_dropped_reward_failed"
                elif max(int(g.prompt_ids.max()), *(int(s.completion_ids.max()) for s in g.samples)) >= self.vocab:
                    why = "groups_dropped_bad_token"
                elif (
                    bad := nonfinite_reason(
                        g, self.advantage_fn, self.cfg.batch.failed_reward, self.cfg.batch.fallback_score
                    )
                ) is not None:
                    # the broker refuses these at ingest; a group that got past it is not trained
                    why = "groups_dropped_nonfinite"
                    log.warning("dropped group %s from %s: %s", g.group_id, g.generator_id, bad)
                elif transform is not None and sampling_transform(g.sampling) != transform:
                    # one batch is recomputed with one sampling transform; a group sampled
                    # differently would be mis-corrected, so it is dropped and counted
                    why = "groups_dropped_sampling_mismatch"
                else:
                    transform = sampling_transform(g.sampling)
                    fresh.append((eid, g))
                    continue
                self.counts[why] += 1
                drops.append((eid, g.group_id if g is not None else "", why))
            queues.drop(self.r, self.keys, drops, self.cfg.batch.record_window)
            if drops:  # visible as they happen (the dashboard, relay status), not at the next training step:
                # during a reward outage no step comes while every group is dropped
                self.r.hset(self.keys.stats("learner"), mapping={w: self.counts[w] for _, _, w in drops})
        return fresh
