"""The learner's weight versions: which number comes next, when the weights are published, and through what.

:class:`Versions` is the learner loop's one way to its publication (learner/publish.py: the store copy and
the announcement, written by a background thread while the next steps train; learner/transports.py: the
transport's sender). Every rank holds one (ZeRO-3 gathers the weights on every rank, a collective); only
the leader's publishes.
"""

from __future__ import annotations

import time
from collections import Counter

import torch.distributed as dist

from broker.client.announcements import latest_announcement
from broker.protocol.keys import Keys
from broker.protocol.signing import AnnounceSigner
from learner.config import LearnerConfig
from learner.engine import full_state_dict
from learner.lora import adapter_config, adapter_publication, merged_state_dict
from learner.publish import (
    BackgroundPublisher,
    Progress,
    Publisher,
    fill,
    first_version,
    publication_dtype,
    resumed_versions,
    snapshot_buffers,
)
from learner.transports import SenderContext, build_sender


class Versions:
    """``version``: the number of the last snapshot handed to the publisher. ``unpublished``: an optimizer
    step changed the weights since. ``blocked_s``: seconds the current step waited for publication
    (snapshot, drains), the step's ``publish_blocked_s``. ``counts`` (the learner's counters):
    ``publish_refused_nonfinite`` (versions refused for non-finite weights) and ``publish_skipped``
    (versions replaced by a newer one while the publisher was busy)."""

    def __init__(
        self,
        cfg: LearnerConfig,
        r,
        keys: Keys,
        announce_key: AnnounceSigner | None,
        weights_key: bytes | None,
        model,
        tokenizer,
        lora_scale: float | None,
        leader: bool,
        counts: Counter,
    ):
        self.cfg, self.r, self.keys, self.announce_key = cfg, r, keys, announce_key
        self.leader, self.lora_scale, self.counts = leader, lora_scale, counts
        # weights.transport: how each version reaches the generators beside its store copy (learner/transports.py)
        self.sender = build_sender(SenderContext(cfg, r, keys, announce_key, weights_key)) if leader else None
        self.publisher = Publisher(
            r,
            keys,
            cfg.weight_store,
            tokenizer,
            cfg.publish.keep_versions,
            announce_key,
            publication_dtype(cfg.weights.dtype, cfg.deepspeed.bf16),
            cfg.weights.shard_mb,
            self.sender.handoff if self.sender else None,
            cfg.weights.digest,
            # never fewer than the staleness bound accepts
            max(cfg.publish.keep_announcements, cfg.batch.max_staleness + 1) if cfg.publish.keep_announcements else 0,
            hash_threads=cfg.weights.hash_threads,
        )
        if cfg.lora_adapters_published:
            self.publisher.adapter_config = adapter_config(model)
        # writes, seals and announces each version while the next steps train (the leader only)
        self.background = BackgroundPublisher(self.publisher, model.config) if leader else None
        if self.sender is not None:
            self.sender.attach(self.publisher)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.blocked_s = 0.0
        self.version = first_version(self._latest(), cfg.weight_store)  # a forged huge version is not ours
        self.publish_first = True  # the weights it starts from are published first (not after a resume that continues)
        self.unpublished = False

    def _latest(self) -> int | None:
        latest = latest_announcement(self.r, self.keys, self.announce_key)
        return latest.version if latest else None

    def resumed(self, state: dict, agree) -> None:
        """Continue the versions where a checkpoint's ``state`` left them (learner/publish.py
        ``resumed_versions``), the leader's decision on every rank (``agree``)."""
        self.version, publish, unpublished = resumed_versions(state, self._latest(), self.cfg.weight_store)
        self.publish_first, self.unpublished = agree(publish), agree(unpublished)

    def checkpoint_state(self, publishes: bool) -> dict:
        """Where the versions stand, for a checkpoint: ``pending``, its weights are published right after
        it as the next version; ``unpublished``, they differ from the last version's."""
        return {"version": self.version, "pending": publishes and self.unpublished, "unpublished": self.unpublished}

    def start(self, engine) -> None:
        """The run's first publication: the weights it starts from, or (a resume that continues the announced
        versions) the latest announcement again, so that the generators load it."""
        if self.publish_first:
            self.publish(engine)
        elif self.leader:
            self.publisher.readvertise(latest_announcement(self.r, self.keys, self.announce_key))
            self.r.hset(self.keys.stats("learner"), mapping={"version": self.version})

    def publish(self, engine) -> None:
        """On every rank (ZeRO-3 gathers the weights, a collective); the leader snapshots them and hands the
        snapshot to its publisher thread, which checks, writes and announces it while training goes on.
        Weights that are not all finite are never published: the publisher refuses the version (nothing
        announced, a collective broadcast of it aborted before its trailer), the generators keep the
        previous one, and the leader counts ``publish_refused_nonfinite`` (the version number stays used)."""
        t0 = time.perf_counter()
        weights = full_state_dict(engine)
        if weights is not None and self.lora_scale is not None:
            if self.cfg.lora_adapters_published:  # the adapter alone (with the base model until one carried it)
                weights = adapter_publication(weights, self.publisher.needs_base)
            else:  # the adapters merged, under the base's names
                weights = merged_state_dict(weights, self.lora_scale)
        self.unpublished = False  # on every rank, whatever the leader decides: the ranks stay in step
        if self.leader:
            self.sender.stage(self.version, weights, self.publisher.dtype, self.tied)  # ipc: into a shared slot, now
            try:  # handed over before it is copied: the collective broadcast streams it as it fills
                state = snapshot_buffers(
                    weights,
                    self.publisher.dtype,
                    self.tied,
                    self.background.spare() or self.publisher.buffers(weights, self.tied),
                )
                progress = Progress()
                self.background.submit(self.version, state, progress)
                fill(state, weights, progress)
            finally:
                del weights
            self.r.hset(self.keys.stats("learner"), mapping={"version": self.version})
        self.blocked_s += time.perf_counter() - t0

    def publish_next(self, engine) -> None:
        """Publish the next version when an optimizer step changed the weights since the last one (a batch
        whose steps were all skipped for non-finite numbers publishes nothing new)."""
        if self.unpublished:
            self.version += 1
            self.publish(engine)

    def drain(self) -> None:
        """Wait (the leader) until every version handed to the publisher is announced; the wait counts as
        blocked time."""
        if self.background is not None:
            t0 = time.perf_counter()
            self.background.drain()
            self.blocked_s += time.perf_counter() - t0

    def take_counts(self) -> None:
        """Move the publisher's refusals and skips into the learner's counters."""
        if self.background is not None:
            self.counts["publish_skipped"] += self.background.take_skipped()
            self.counts["publish_refused_nonfinite"] += self.background.take_refused()

    def close(self) -> None:
        """Drain the publisher and end its thread (the last version is announced before ``done``), then close the
        sender (the ipc transport stops sharing: its slots unlinked; the store holds every version)."""
        if self.background is not None:
            self.background.close()
            self.take_counts()
        if self.sender is not None:
            self.sender.close()

    def finish(self) -> None:
        """The run is over: the sender finishes (the http transport serves until the generators have the last
        version, their final evaluation round uses it, at most ``weights.transport.linger_s``)."""
        if self.sender is not None:
            self.sender.finish(self.version)


def agree(flag: bool, world: int) -> bool:
    """The leader's ``flag`` on every rank (a collective when there are several)."""
    if world == 1:
        return flag
    import torch

    t = torch.tensor([int(flag)])
    dist.broadcast(t, 0)
    return bool(t.item())
