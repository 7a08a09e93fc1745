"""The generator's sink: a thread that scores, sends and releases each generated batch while the
engine generates the next one, so the engine never waits for the reward service or the broker.

The hand-over holds one batch: a slow broker (``busy``) or reward service slows generation after
one batch instead of piling up memory. A prompt is released (XACK + XDEL) only after the broker's
final ack for its group, so a generator that dies loses nothing: its pending prompts are reclaimed
by another generator. An error in the sink is fatal: it is recorded, the stop flag is set, and the
batch's prompts stay pending (reclaimed later); a configuration error (the reward service refusing the
generator's token, generators/reward_client.py) is kept as ``failure`` so the generator exits with it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
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
from broker.runtime.config import ConfigError
from generators.backends.base import Completion
from generators.config import GeneratorConfig
from generators.leases import Leases
from generators.reward_client import RewardClient

log = logging.getLogger("relay.generator.sink")

# reason codes (before the colon) of a failure that says the scorer is out, not that the item is bad: the
# generator's own (reward_service: the service unreachable after its retries) and a remote plugin's
# (docs/rewards.md, "retried": 5xx/429, timeout, unreachable, circuit open)
OUTAGE_CODES = ("reward_service", "remote_timeout", "remote_unreachable", "remote_circuit_open", "remote_http_429")


def outage(results: list[list[ResultOut]]) -> str | None:
    """The reason when every result of a batch failed for an outage (then scoring it again later may
    succeed); None when at least one item was scored, or failed for a reason of its own."""
    flat = [r for rs in results for r in rs]
    if not flat:
        return None
    for r in flat:
        code = r.reason.split(":", 1)[0].strip()
        if r.ok or not (code in OUTAGE_CODES or (code.startswith("remote_http_5") and len(code) == 15)):
            return None
    return flat[0].reason[:200]


@dataclass
class Batch:
    """One generated batch on its way to the broker."""

    claimed: list[tuple[bytes, PromptEntry]]  # (prompts-stream entry id, the prompt), one per prompt
    prompt_ids: list[list[int]]  # the token ids each prompt was fed as
    groups: list[list[Completion]]  # each prompt's completions
    version: int  # the weight version (and hash) served when the batch started
    weight_hash: str
    created_at: float


def sender_keys(cfg: GeneratorConfig) -> CurveClientKeys | None:
    """This generator's CURVE keys (None with ingest_auth = "insecure"); a missing file fails here, at start."""
    return load_client_keys(cfg.ingest_key_file, cfg.broker_public_key_file) if cfg.ingest_auth == "curve" else None


@dataclass
class RewardTally:
    """The rewards of the samples a generator sent, as its heartbeat reports them (``fields``)."""

    ok: int = 0  # samples whose reward was scored
    failures: int = 0
    failures_by_plugin: dict[str, int] = field(default_factory=dict)
    last_failure: dict[str, str] = field(default_factory=dict)  # plugin -> the reason of its latest failed sample
    pauses: int = 0  # outages that held a batch (paused_reward)
    paused_s: float = 0.0  # seconds spent holding batches through them

    def count(self, r: ResultOut) -> None:
        if r.ok:
            self.ok += 1
            return
        self.failures += 1
        plugin = r.plugin or "unknown"
        self.failures_by_plugin[plugin] = self.failures_by_plugin.get(plugin, 0) + 1
        self.last_failure[plugin] = r.reason[:200]

    def fields(self) -> dict:
        """The heartbeat's ``reward_*`` fields (broker/protocol/messages.py ``Heartbeat``)."""
        return {
            "reward_failures": self.failures,
            "reward_failures_by_plugin": dict(self.failures_by_plugin),
            "reward_pauses": self.pauses,
            "reward_paused_s": round(self.paused_s, 1),
            "reward_ok": self.ok,
            "reward_last_failure": dict(self.last_failure),
        }


class Sink:
    def __init__(
        self,
        cfg: GeneratorConfig,
        r: redis.Redis,
        keys: Keys,
        rewards: RewardClient,
        decode: Callable[[list[int]], str],
        stop: threading.Event,
        heartbeat: Callable[[], None],
        curve: CurveClientKeys | None = None,
        hash_for: Callable[[int], str] | None = None,
        leases: Leases | None = None,
    ):
        self.cfg, self.r, self.keys, self.rewards, self.decode = cfg, r, keys, rewards, decode
        self.leases = leases  # the generator's held prompts: each one released here stops being renewed
        # a batch generated by a version applied before its announcement (the collective transport) has no
        # weight_hash yet: looked up here, when its groups are sent (WeightApplier.hash_for)
        self.hash_for = hash_for
        self.stop, self.heartbeat = stop, heartbeat
        self.sender = GroupSender(cfg.broker_address, curve=curve)
        self.state = "idle"  # idle | scoring | sending | paused_backpressure | paused_reward (in the heartbeat)
        self.scored = RewardTally()  # the rewards of the samples sent: scored, failed (by plugin), outages held
        self.error = ""
        self.failure: BaseException | None = None  # the exception behind ``error``
        self.groups_sent = self.groups_rejected = 0
        self._outbox: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._loop, name="sink", daemon=True)
        self._extra_sender: GroupSender | None = None  # send_group's (another thread's) socket
        self._extra_lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def check_ingest_key(self, timeout_s: float = 5.0) -> None:
        """With CURVE, learn at once whether the broker admits this generator's key (GroupSender.wait_connected)
        rather than time out on every group: a refused key, or a broker without CURVE, stops the generator
        with the reason (exit 2; no retry can fix it). A broker not answering yet is only logged: the groups
        wait for it as they always do. Called before :meth:`start`: the sink's thread has not started, so its
        socket is the caller's."""
        if self.sender.curve is None:
            return
        try:
            self.sender.wait_connected(timeout_s)
        except (PermissionError, ConnectionError) as e:
            log.error("the broker's ingest refuses this generator: %s", e)
            raise SystemExit(2) from None
        except TimeoutError as e:
            log.warning("%s; the groups wait until it answers", e)

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
        """Deliver the batch it holds, then end the thread. A sink that dies meanwhile (a fatal error with a
        batch still waiting at the hand-over) takes nothing more: the wait ends with it, not forever."""
        while self._thread.is_alive():
            try:
                self._outbox.put(None, timeout=0.5)
                break
            except queue.Full:
                continue
        self._thread.join()

    def close(self) -> None:
        self.sender.close()
        if self._extra_sender is not None:
            self._extra_sender.close()

    def send_group(self, g: Group):
        """Send one group that no claimed prompt stands behind (the OpenAI endpoint's sessions:
        generators/openai_endpoint.py) and return the broker's final Ack. Called from other threads than
        the sink's: it has its own sender (a ZeroMQ socket is used by one thread), one call at a time.
        Counted with the sink's groups (sent / rejected); ``TimeoutError`` when the broker never answers."""
        with self._extra_lock:
            if self._extra_sender is None:
                self._extra_sender = GroupSender(self.cfg.broker_address, curve=self.sender.curve)
            ack = self._extra_sender.send(g.group_id, encode_group(g), give_up_s=60.0, should_stop=self.stop.is_set)
            if ack.status == "rejected":
                self.groups_rejected += 1
                log.error("broker rejected group %s: %s", g.group_id, ack.reason)
            else:
                self.groups_sent += 1
            return ack

    def _loop(self) -> None:
        while True:
            batch = self._outbox.get()
            try:
                if batch is None:
                    return
                self._deliver(batch)
            except BaseException as e:  # noqa: BLE001 - recorded and fatal: the process exits non-zero
                self.error, self.failure = f"{type(e).__name__}: {e}", e
                log.critical(
                    "sink failed (%s); stopping: the batch's prompts stay pending and are reclaimed",
                    self.error,
                    exc_info=not isinstance(e, ConfigError),
                )
                self.stop.set()
                return
            finally:
                self._outbox.task_done()

    def _deliver(self, b: Batch) -> None:
        """Score one batch, send its groups, then release their prompts."""
        prompts = [f for _, f in b.claimed]
        self.state = "scoring"
        scores = self._score_through_outages(prompts, b.groups)
        scored = time.time()
        if not b.weight_hash and self.hash_for is not None:
            b.weight_hash = self.hash_for(b.version)
        for (eid, p), pid, cs, rs in zip(b.claimed, b.prompt_ids, b.groups, scores):
            g = Group(
                group_id=Group.new_id(),
                run_id=self.cfg.run_id,
                prompt_id=eid.decode(),
                prompt_ids=np.asarray(pid, dtype=np.int32),
                samples=[self._sample(c, r, b.version) for c, r in zip(cs, rs)],
                generator_id=self.cfg.id,
                weight_version=b.version,
                weight_hash=b.weight_hash,
                sampling=self.cfg.sampling.model_dump(),
                task=p.task,
                reference=p.reference,
                created_at=b.created_at,
                scored_at=scored,
                sent_at=time.time(),
            )
            self.state = "sending"
            ack = self.sender.send(
                g.group_id, encode_group(g), should_stop=self.stop.is_set, on_busy=self._paused_by_backpressure
            )
            if ack.status == "rejected":
                self.groups_rejected += 1
                log.error("broker rejected group %s: %s", g.group_id, ack.reason)
            else:
                self.groups_sent += 1
            self._release(eid)  # the group is safe in Redis (or accounted as rejected)
        self.state = "idle"
        self.heartbeat()

    def _score_through_outages(
        self, prompts: list[PromptEntry], groups: list[list[Completion]]
    ) -> list[list[ResultOut]]:
        """Score a batch. While every item comes back failed for an outage (:func:`outage`), hold it and
        score it again (back-off 1 s doubling to 30 s; state ``paused_reward``): the generator claims no new
        prompts meanwhile (two more batches at most: one waiting at the hand-over, one in the engine), so an outage
        burns no prompts and drops nothing. After ``reward_outage_hold_s`` (or on stop) the batch goes
        out with its failures, counted as before."""
        backoff, since = Backoff(1.0, 30.0), None
        while True:
            scores = self.rewards.score_groups(prompts, groups, self.decode)
            why = outage(scores)
            now = time.monotonic()
            if (
                why is None
                or self.stop.is_set()
                or (since is not None and now - since >= self.cfg.reward.outage_hold_s)
            ):
                break
            if since is None:
                since = now
                self.scored.pauses += 1
                log.warning(
                    "reward outage (%s): holding the batch of %d prompt(s) and scoring it again with "
                    "back-off; no new prompts are claimed meanwhile",
                    why,
                    len(prompts),
                )
            self.state = "paused_reward"
            self.heartbeat()
            self.stop.wait(min(backoff.next(), max(0.0, since + self.cfg.reward.outage_hold_s - now)))
        if since is not None:
            self.scored.paused_s += now - since
            if why is None:
                log.info("reward outage over after %.1fs: the held batch is scored", now - since)
            else:
                log.error(
                    "reward outage lasted %.1fs (reward_outage_hold_s %.0f): the batch goes out failed (%s)",
                    now - since,
                    self.cfg.reward.outage_hold_s,
                    why,
                )
            self.state = "scoring"
        return scores

    def _sample(self, c: Completion, r: ResultOut, version: int) -> Sample:
        self.scored.count(r)
        return Sample(
            completion_ids=np.asarray(c.token_ids, dtype=np.int32),
            logprobs=np.asarray(c.logprobs, dtype=np.float32),
            version_runs=versions_to_runs(c.versions) if c.versions else [[version, len(c.token_ids)]],
            finish_reason=c.finish_reason,
            reward=float(r.score) if r.ok else None,
            reward_status="ok" if r.ok else "failed",
            reward_details={**r.details, **({"reason": r.reason} if not r.ok else {})},
            trainable=None if c.trainable is None else np.asarray(c.trainable, dtype=np.uint8),
        )

    def _release(self, eid: bytes) -> None:
        """XACK + XDEL one prompt, retrying through a Redis outage (0.2 s doubling to 5 s; once
        stopped, it gives up at the longest wait: then the prompt stays pending and may be generated
        again by another generator; the group already sent is kept, so that prompt is trained twice
        under two group ids, never one group twice)."""
        if self.leases is not None:  # first: a renewal must not see it gone while still held
            self.leases.release(self.keys.prompts, eid)
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
