"""The prompt feeder: keeps the prompts stream topped up from the built-in task or a dataset, and
resumes exactly where it was after a restart (its position is written with its prompts)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import redis
from prometheus_client import CollectorRegistry, Counter

from broker.client import queues
from broker.client.announcements import latest_announcement
from broker.config import BrokerConfig
from broker.prompts.datasets import DatasetSource, Position, check_dataset, load_tokenizer, read_rows
from broker.prompts.tasks import TaskSource
from broker.protocol.keys import Keys
from broker.protocol.signing import AnnounceVerifier

log = logging.getLogger("relay.broker.feeder")

# the prompts stream is topped up at most this often
FEED_EVERY_S = 0.1


class PromptFeeder:
    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        cfg: BrokerConfig,
        registry: CollectorRegistry,
        announce_key: AnnounceVerifier | None = None,
    ):
        self.r, self.keys, self.cfg = r, keys, cfg
        self.announce_key = announce_key  # the tokenizer comes from a verified announcement's folder only
        self._next_feed = 0.0
        # the prompt source: the built-in task, or a dataset (its rows read now, so a bad path or
        # field mapping stops the broker at start; its tokenizer once the weights are announced, or
        # now when the dataset names its own: then the first rows are built into prompts at start too)
        self.dataset_rows = None
        if cfg.dataset:
            self.dataset_rows = read_rows(cfg.dataset)
            if cfg.dataset.tokenizer:
                check_dataset(cfg.dataset, load_tokenizer(cfg.dataset.tokenizer), self.dataset_rows)
        self.source = None if cfg.dataset else TaskSource(cfg.task)
        self.position = Position.from_fields(self.r.hgetall(self.keys.feeder))  # resume where the feeder was
        self.exhausted_logged = False
        self.m_prompts = Counter("relay_broker_prompts_fed", "prompts added to the prompts stream", registry=registry)

    def _tokenizer(self, path: str):
        """The dataset's tokenizer: the configured folder, else the announced weights' (None until announced)."""
        if not path:
            latest = latest_announcement(self.r, self.keys, self.announce_key)
            if latest is None:
                return None
            path = latest.path
        return load_tokenizer(path)

    def eval_source(self):
        """Where evaluation rounds take their held-out prompts (None until the tokenizer is known)."""
        cfg = self.cfg
        if cfg.eval.dataset is not None or cfg.dataset is not None:
            ds = cfg.eval.dataset or cfg.dataset.model_copy(
                update={"start": 0, "stop": cfg.dataset.start or None, "epochs": None}
            )
            if cfg.eval.dataset is None and not cfg.dataset.start:
                raise ValueError(
                    "evaluation needs a held-out set: set broker.eval.dataset, or broker.dataset.start "
                    "to leave the first rows out of training, or broker.eval.every_versions = 0"
                )
            tok = self._tokenizer(ds.tokenizer or (cfg.dataset.tokenizer if cfg.dataset else ""))
            return None if tok is None else DatasetSource(ds, tok)
        return TaskSource(cfg.task.model_copy(update={"seed": cfg.eval.seed}))

    def feed(self) -> None:
        """Top the prompts stream up to ``prompt_backlog`` entries (generators delete what they finish),
        at most every ``FEED_EVERY_S``.

        The prompts and the feeder's new position go to Redis in one MULTI/EXEC: a broker killed at
        any moment resumes after the last prompt it added, never skipping or repeating one."""
        now = time.monotonic()
        if now < self._next_feed:
            return
        self._next_feed = now + FEED_EVERY_S
        missing = self.cfg.prompt_backlog - queues.prompts_ready(self.r, self.keys)
        if missing <= 0:
            return
        if self.source is None:
            tok = self._tokenizer(self.cfg.dataset.tokenizer)
            if tok is None:
                return  # the learner has not announced the weights (and their tokenizer) yet
            self.source = DatasetSource(self.cfg.dataset, tok, rows=self.dataset_rows)
        if self.source.exhausted(self.position):
            if not self.exhausted_logged:
                # the learner ends the run once the last of these prompts are trained (learner/intake.py)
                self.r.hset(self.keys.stats("broker"), "dataset_exhausted", 1)
                log.info(
                    "the dataset is exhausted after %d epoch(s): %d prompts fed, %d skipped as too long",
                    self.position.epoch,
                    self.position.fed,
                    self.position.skipped,
                )
                self.exhausted_logged = True
            return
        got, pos = self.source.take(missing, self.position)
        pipe = self.r.pipeline(transaction=True)
        for n, (epoch, row, rec) in enumerate(got, self.position.fed + 1):
            queues.add_prompt(pipe, self.keys.prompts, replace(rec, seq=n, epoch=epoch, row=row))
        pipe.hset(self.keys.feeder, mapping=pos.as_fields())
        pipe.hset(
            self.keys.stats("broker"),
            mapping={
                "prompts_fed": pos.fed,
                "prompts_skipped_too_long": pos.skipped,
                "epoch": pos.epoch,
                "dataset_exhausted": int(self.source.exhausted(pos)),
            },
        )
        pipe.execute()
        if pos.skipped > self.position.skipped:
            log.warning(
                "skipped %d prompt(s) longer than max_prompt_tokens (%d so far)",
                pos.skipped - self.position.skipped,
                pos.skipped,
            )
        self.position = pos
        self.m_prompts.inc(len(got))
