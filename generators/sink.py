"""The generator's sink: a thread that scores, sends and releases each generated batch while the
engine generates the next one, so the engine never waits for the reward service or the broker.

The hand-over holds one batch: a slow broker (``busy``) or reward service slows generation after
one batch instead of piling up memory. A prompt is released (XACK + XDEL) only after the broker's
final ack for its group, so a generator that dies loses nothing: its pending prompts are reclaimed
by another generator. An error in the sink is fatal: it is recorded, the stop flag is set, and the
batch's prompts stay pending (reclaimed later).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import redis

from broker.client import queues
from broker.client.connection import Backoff
from broker.client.sender import GroupSender
from broker.protocol.group import Group, Sample, encode_group, versions_to_runs
from broker.protocol.ingest_auth import CurveClientKeys, load_client_keys
from broker.protocol.keys import Keys
from broker.protocol.messages import PromptEntry, ResultOut
from generators.backends.base import Completion
from generators.config import GeneratorConfig
from generators.reward_client import RewardClient

log = logging.getLogger("relay.generator.sink")


@dataclass
class Batch:
    """One generated batch on its way to the broker."""

    claimed: list[tuple[bytes, PromptEntry]]  # (prompts-stream entry id, the prompt), one per prompt
    prompt_ids: list[list[int]]        # the token ids each prompt was fed as
    groups: list[list[Completion]]     # each prompt's completions
    version: int                       # the weight version (and hash) served when the batch started
    weight_hash: str
    created_at: float


def sender_keys(cfg: GeneratorConfig) -> CurveClientKeys | None:
    """This generator's CURVE keys (None with ingest_auth = "insecure"); a missing file fails here, at start."""
    return load_client_keys(cfg.ingest_key_file, cfg.broker_public_key_file) if cfg.ingest_auth == "curve" else None


class Sink:
    def __init__(self, cfg: GeneratorConfig, r: redis.Redis, keys: Keys, rewards: RewardClient,
                 decode: Callable[[list[int]], str], stop: threading.Event, heartbeat: Callable[[], None],
                 curve: CurveClientKeys | None = None):
        self.cfg, self.r, self.keys, self.rewards, self.decode = cfg, r, keys, rewards, decode
        self.stop, self.heartbeat = stop, heartbeat
        self.sender = GroupSender(cfg.broker_address, curve=curve)
        self.state = "idle"  # idle | scoring | sending | paused_backpressure (reported in the heartbeat)
        self.error = ""
        self.groups_sent = self.groups_rejected = self.reward_failures = 0
        self.reward_failures_by_plugin: dict[str, int] = {}
        self._outbox: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._loop, name="sink", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def offer(self, batch: Batch, timeout_s: float) -> bool:
        """Hand a batch over; False when the sink still holds the previous one after ``timeout_s``."""
        try:
            self._outbox.put(batch, timeout=timeout_s)
            return True
        except queue.Full:
            return False

    def drain(self) -> None:
        """Deliver the batch it holds, then end the thread."""
        if self._thread.is_alive():
            self._outbox.put(None)
            self._thread.join()

    def close(self) -> None:
        self.sender.close()

    def _loop(self) -> None:
        while True:
            batch = self._outbox.get()
            try:
                if batch is None:
                    return
                self._deliver(batch)
            except BaseException as e:  # noqa: BLE001 - recorded and fatal: the process exits non-zero
                self.error = f"{type(e).__name__}: {e}"
                log.critical("sink failed (%s); stopping: the batch's prompts stay pending and are reclaimed",
                             self.error, exc_info=True)
                self.stop.set()
                return
            finally:
                self._outbox.task_done()

    def _deliver(self, b: Batch) -> None:
        """Score one batch, send its groups, then release their prompts."""
        prompts = [f for _, f in b.claimed]
        self.state = "scoring"
        scores = self.rewards.score_groups(prompts, b.groups, self.decode)
        scored = time.time()
        for (eid, p), pid, cs, rs in zip(b.claimed, b.prompt_ids, b.groups, scores):
            g = Group(group_id=Group.new_id(), run_id=self.cfg.run_id, prompt_id=eid.decode(),
                      prompt_ids=np.asarray(pid, dtype=np.int32),
                      samples=[self._sample(c, r, b.version) for c, r in zip(cs, rs)], generator_id=self.cfg.id,
                      weight_version=b.version, weight_hash=b.weight_hash, sampling=self.cfg.sampling.model_dump(),
                      task=p.task, reference=p.reference, created_at=b.created_at, scored_at=scored,
                      sent_at=time.time())
            self.state = "sending"
            ack = self.sender.send(g.group_id, encode_group(g), should_stop=self.stop.is_set,
                                   on_busy=self._paused_by_backpressure)
            if ack.status == "rejected":
                self.groups_rejected += 1
                log.error("broker rejected group %s: %s", g.group_id, ack.reason)
            else:
                self.groups_sent += 1
            self._release(eid)  # the group is safe in Redis (or accounted as rejected)
        self.state = "idle"
        self.heartbeat()

    def _sample(self, c: Completion, r: ResultOut, version: int) -> Sample:
        if not r.ok:
            self.reward_failures += 1
            plugin = r.plugin or "unknown"
            self.reward_failures_by_plugin[plugin] = self.reward_failures_by_plugin.get(plugin, 0) + 1
        return Sample(
            completion_ids=np.asarray(c.token_ids, dtype=np.int32),
            logprobs=np.asarray(c.logprobs, dtype=np.float32),
            version_runs=versions_to_runs(c.versions) if c.versions else [[version, len(c.token_ids)]],
            finish_reason=c.finish_reason,
            reward=float(r.score) if r.ok else None,
            reward_status="ok" if r.ok else "failed",
            reward_details={**r.details, **({"reason": r.reason} if not r.ok else {})},
        )

    def _release(self, eid: bytes) -> None:
        """XACK + XDEL one prompt, retrying through a Redis outage (0.2 s doubling to 5 s; once
        stopped, it gives up at the longest wait: then the prompt stays pending and may be generated
        again by another generator; the group already sent is kept, so that prompt is trained twice
        under two group ids, never one group twice)."""
        backoff = Backoff(0.2, 5.0)
        while True:
            try:
                pipe = self.r.pipeline()
                queues.release(pipe, self.keys.prompts, eid)
                pipe.execute()
                return
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if self.stop.is_set() and backoff.at_cap:
                    log.error("could not release prompt %s before stopping: %s", eid, e)
                    return
                log.warning("redis unavailable while releasing prompt %s (%s); retrying", eid, e)
                backoff.sleep()

    def _paused_by_backpressure(self) -> None:
        """The broker answered busy (its queue is full): show it until the group is accepted."""
        self.state = "paused_backpressure"
        self.heartbeat()
