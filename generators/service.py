"""The generator service loop: claim prompts -> sample groups -> score -> send -> ack prompts.

Between batches it applies any newer announced weight version in place (verified file by file
against the manifest; a bad snapshot is refused, counted and reported in the heartbeat, and the
previous version keeps serving). A prompt is acknowledged (XACK + XDEL) only after the broker
confirmed its group is in Redis, so a generator that dies loses nothing: its pending prompts are
reclaimed by another generator after ``claim_idle_s``.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time
import zlib

import httpx
import numpy as np
import redis

from broker.client.announcements import latest_announcement
from broker.client.connection import connect_redis
from broker.client import queues
from broker.client.sender import GroupSender
from broker.client.telemetry import emit_event, heartbeat
from broker.protocol import weightstore
from broker.protocol.keys import Keys
from broker.protocol.group import Group, Sample, encode_group, versions_to_runs
from generators.backends import make_backend
from generators.backends.base import Completion
from generators.config import GeneratorConfig
from generators.eval import Evaluator
from generators.metrics import serve_metrics
from generators.prompts import prompt_token_ids

log = logging.getLogger("relay.generator")


class Generator:
    def __init__(self, cfg: GeneratorConfig):
        self.cfg = cfg
        self.keys = Keys(cfg.run_id)
        self.r = connect_redis(cfg.redis_url)
        self.sender = GroupSender(cfg.broker_address)
        self.http = httpx.Client(base_url=cfg.reward_url, timeout=cfg.reward_timeout_s,
                                 headers={"Authorization": f"Bearer {cfg.reward_token}"} if cfg.reward_token else None)
        self.backend = make_backend(cfg.backend)
        self.version: int | None = None
        self.hash = ""
        self.refused: dict[str, str] = {}  # hash -> reason, so a bad snapshot is not retried forever
        self.state = "starting"
        self.stop = threading.Event()
        self.stats = {"groups_sent": 0, "groups_rejected": 0, "tokens": 0, "updates": 0, "refused_updates": 0,
                      "reward_failures": 0, "reward_failures_by_plugin": {}, "last_update_latency_s": None}
        self._t_tokens = time.monotonic()
        self._tokens_per_s = 0.0
        self._last_hb = 0.0
        self._batch = 0
        self._outbox: queue.Queue = queue.Queue(maxsize=1)  # generated batches waiting for the sink
        self._sink = threading.Thread(target=self._sink_loop, name="sink", daemon=True)
        self._sink_error = ""
        self.sink_state = "idle"
        self.metrics = serve_metrics(self)  # /metrics and /healthz; its port goes into every heartbeat
        self.evaluator = Evaluator(self)  # held-out evaluation rounds, between training batches (docs/eval.md)

    # -- weights --------------------------------------------------------------------------------

    def maybe_update(self, block: bool = False) -> None:
        """Apply the latest announced version if it is newer than the one served."""
        while True:
            a = latest_announcement(self.r, self.keys)
            if a is not None or not block or self.stop.is_set():
                break
            self.state = "waiting_for_weights"
            self.send_heartbeat(force=True)
            time.sleep(0.2)
        while a is not None and (self.version is None or a.version > self.version) and a.hash not in self.refused:
            self.state = "updating"
            try:
                weightstore.verify(a.path, a.hash)
                if self.version is None:
                    self.backend.load(a.path)
                else:
                    self.backend.update_weights(a.path)
                break
            except (weightstore.WeightStoreError, ValueError, OSError) as e:
                newer = latest_announcement(self.r, self.keys)
                if newer is not None and newer.version > a.version:
                    # superseded while we read it (and perhaps pruned): not a bad snapshot
                    log.warning("version %d was superseded while loading (%s); loading version %d instead",
                                a.version, e, newer.version)
                    a = newer
                    continue
                reason = getattr(e, "reason", type(e).__name__)
                self.refused[a.hash] = reason
                self.stats["refused_updates"] += 1
                log.error("refused weight version %d (%s): %s; still serving version %s", a.version, reason, e,
                          self.version)
                emit_event(self.r, self.keys, "refused", generator=self.cfg.id, version=a.version, reason=reason)
                if self.version is None:
                    raise RuntimeError(f"cannot load the initial weights: {e}") from e
                return
        else:
            return
        latency = time.time() - a.published_at
        self.version, self.hash = a.version, a.hash
        self.stats["updates"] += 1
        self.stats["last_update_latency_s"] = round(latency, 4)
        emit_event(self.r, self.keys, "applied", generator=self.cfg.id, version=a.version, latency_s=latency)
        self.state = "sampling"  # the update is done; sampling resumes right after (the heartbeat says so)
        log.info("serving version %d (%s) %.3fs after publication", a.version, a.hash[:12], latency)
        self.send_heartbeat(force=True)

    def send_heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_hb < self.cfg.heartbeat_s:
            return
        self._last_hb = now
        heartbeat(self.r, self.keys, self.cfg.id, {
            "backend": self.backend.name, "version": self.version, "hash": self.hash,
            # back-pressure on the sink shows even while the engine is busy generating
            "state": "paused_backpressure" if self.sink_state == "paused_backpressure" else self.state,
            "sink_state": self.sink_state, "in_flight": self.cfg.in_flight,
            "engine": self.backend.engine_info() if self.version is not None and hasattr(self.backend, "engine_info")
            else {},
            "tokens_per_s": round(self._tokens_per_s, 1), "refused": dict(list(self.refused.items())[-3:]),
            "metrics_port": self.metrics.port,
            **self.stats,
        })

    # -- prompts --------------------------------------------------------------------------------

    def claim(self) -> list[tuple[bytes, dict]]:
        """Claim up to prompts_per_batch prompts: first ones abandoned by dead generators (already
        admitted), then new ones as far as staleness admission control allows."""
        n = self.cfg.prompts_per_batch
        out = queues.claim_abandoned(self.r, self.keys.prompts, self.cfg.id, self.cfg.claim_idle_s, n)
        want = n - len(out)
        granted = queues.admit(self.r, self.keys, want) if want else 0
        if want and not granted and not out:
            self.state = "paused_staleness"
            self.send_heartbeat()
            time.sleep(0.02)
            return []
        if granted:
            got = queues.claim_new(self.r, self.keys.prompts, self.cfg.id, granted, block_ms=500)
            queues.unadmit(self.r, self.keys, granted - len(got))
            out.extend(got)
        if not out:
            self.state = "waiting_for_prompts"
            self.send_heartbeat()
        return out

    def score(self, prompts: list[dict], groups: list[list[Completion]]) -> list[list[dict]]:
        """One reward call for the whole batch. Failures are marked, never turned into 0."""
        items = [{"prompt": p["text"], "completion": self.backend.decode(c.token_ids), "reference": p["reference"],
                  "finished": c.finish_reason == "stop", "task": p["task"], "num_tokens": len(c.token_ids),
                  "metadata": json.loads(p.get("metadata") or "{}")}
                 for p, cs in zip(prompts, groups) for c in cs]
        delay, last_err, failures, down_since = 0.2, "", 0, None
        while True:
            try:
                resp = self.http.post("/score", json={"items": items})
                resp.raise_for_status()
                results = resp.json()["results"]
                if len(results) != len(items):
                    raise ValueError(f"{len(results)} results for {len(items)} items")
                break
            except (httpx.HTTPError, ValueError, KeyError) as e:
                last_err = f"{type(e).__name__}: {e}"[:200]
                now = time.monotonic()
                # refused connections: nothing reached the service (down, or being restarted), so wait
                # for it up to reward_down_s before these count as failed attempts
                down_since = (down_since or now) if isinstance(e, httpx.ConnectError) else None
                if down_since is not None and now - down_since < self.cfg.reward_down_s and not self.stop.is_set():
                    log.warning("reward service unreachable for %.1fs, waiting for it: %s", now - down_since, last_err)
                else:
                    failures += 1
                    log.warning("reward call failed (attempt %d): %s", failures, last_err)
                    if failures > self.cfg.reward_retries:
                        results = [{"score": None, "status": "failed", "reason": f"reward_service: {last_err}",
                                    "plugin": "reward_service"}] * len(items)
                        break
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        k = iter(results)
        return [[next(k) for _ in cs] for cs in groups]

    # -- main loop ------------------------------------------------------------------------------
    #
    # Two threads: the main one claims prompts and keeps the engine generating; the sink scores,
    # sends and acknowledges the previous batch meanwhile, so the engine never waits for the reward
    # service or the broker. The hand-over queue holds one batch: a slow broker (busy) or reward
    # service slows generation after one batch instead of piling up memory.

    def _on_step(self) -> int:
        """In-flight "continue": between two decode steps, load a newer version if one is announced."""
        self.maybe_update()
        return self.version

    def step(self) -> bool:
        """Generate one batch and hand it to the sink. Returns False when there was nothing to do."""
        self.maybe_update()
        self.evaluator.serve()  # waiting held-out prompts first (a few per round, every N versions)
        claimed = self.claim()  # sets (and reports) paused_staleness while admission is closed
        if not claimed:
            return False
        self.state = "sampling"
        self.send_heartbeat()
        prompts = [f for _, f in claimed]
        ids = [prompt_token_ids(p, self.backend.encode) for p in prompts]  # the feeder's ids when it sent them
        version, whash = self.version, self.hash
        t0 = time.monotonic()
        self._batch += 1
        groups = self.backend.generate(ids, self.cfg.sampling,
                                       seed=zlib.crc32(f"{self.cfg.seed}:{self.cfg.id}:{self._batch}".encode()),
                                       on_step=self._on_step if self.cfg.in_flight == "continue" else None)
        ntok = sum(len(c.token_ids) for cs in groups for c in cs)
        self._tokens_per_s = ntok / max(time.monotonic() - t0, 1e-9)
        self.stats["tokens"] += ntok
        batch = (claimed, ids, groups, version, whash, time.time())
        while True:  # blocks while the sink still holds a batch: back-pressure reaches generation here
            if not self._sink.is_alive():
                if self.stop.is_set():  # it failed and asked to stop: run() drains, reports and exits
                    return True  # this batch's prompts stay pending and are reclaimed
                raise RuntimeError(f"the sink thread died: {self._sink_error}")
            try:
                self._outbox.put(batch, timeout=0.5)
                break
            except queue.Full:  # meanwhile keep the weights current: the next batch starts from them
                self.maybe_update()
                self.send_heartbeat()
        return True

    def _sink_loop(self) -> None:
        while True:
            batch = self._outbox.get()
            try:
                if batch is None:
                    return
                self._deliver(*batch)
            except BaseException as e:  # noqa: BLE001 - recorded and fatal: the process exits non-zero
                self._sink_error = f"{type(e).__name__}: {e}"
                log.critical("sink failed (%s); stopping: the batch's prompts stay pending and are reclaimed",
                             self._sink_error, exc_info=True)
                self.stop.set()
                return
            finally:
                self._outbox.task_done()

    def _deliver(self, claimed, ids, groups, version, whash, created) -> None:
        """Score one batch, send its groups, then release their prompts."""
        prompts = [f for _, f in claimed]
        self.sink_state = "scoring"
        scores = self.score(prompts, groups)
        scored = time.time()
        for (eid, p), pid, cs, rs in zip(claimed, ids, groups, scores):
            samples = []
            for c, r in zip(cs, rs):
                ok = r.get("status") == "ok" and r.get("score") is not None
                if not ok:
                    self.stats["reward_failures"] += 1
                    by_plugin = self.stats["reward_failures_by_plugin"]
                    plugin = r.get("plugin") or "unknown"
                    by_plugin[plugin] = by_plugin.get(plugin, 0) + 1
                samples.append(Sample(
                    completion_ids=np.asarray(c.token_ids, dtype=np.int32),
                    logprobs=np.asarray(c.logprobs, dtype=np.float32),
                    version_runs=versions_to_runs(c.versions) if c.versions else [[version, len(c.token_ids)]],
                    finish_reason=c.finish_reason,
                    reward=float(r["score"]) if ok else None,
                    reward_status="ok" if ok else "failed",
                    reward_details={**r.get("details", {}), **({"reason": r.get("reason", "")} if not ok else {})},
                ))
            g = Group(group_id=Group.new_id(), run_id=self.cfg.run_id, prompt_id=eid.decode(),
                      prompt_ids=np.asarray(pid, dtype=np.int32), samples=samples, generator_id=self.cfg.id,
                      weight_version=version, weight_hash=whash, sampling=self.cfg.sampling.model_dump(),
                      task=p["task"], reference=p["reference"], created_at=created, scored_at=scored,
                      sent_at=time.time())
            self.sink_state = "sending"
            ack = self.sender.send(g.group_id, encode_group(g), should_stop=self.stop.is_set,
                                   on_busy=self._paused_by_backpressure)
            if ack.status == "rejected":
                self.stats["groups_rejected"] += 1
                log.error("broker rejected group %s: %s", g.group_id, ack.reason)
            else:
                self.stats["groups_sent"] += 1
            self._release(eid)  # the group is safe in Redis (or accounted as rejected)
        self.sink_state = "idle"
        self.send_heartbeat()

    def _release(self, eid: bytes) -> None:
        """XACK + XDEL one prompt, retrying through a Redis outage (until stopped: then the prompt
        stays pending and may be generated again by another generator; the group already sent is
        kept, so that prompt is trained twice under two group ids, never one group twice)."""
        delay = 0.2
        while True:
            try:
                pipe = self.r.pipeline()
                queues.release(pipe, self.keys.prompts, eid)
                pipe.execute()
                return
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if self.stop.is_set() and delay >= 5.0:
                    log.error("could not release prompt %s before stopping: %s", eid, e)
                    return
                log.warning("redis unavailable while releasing prompt %s (%s); retrying", eid, e)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _paused_by_backpressure(self) -> None:
        """The broker answered busy (its queue is full): show it until the group is accepted."""
        self.sink_state = "paused_backpressure"
        self.send_heartbeat()

    def run(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        self._sink.start()
        self.maybe_update(block=True)
        while not self.stop.is_set():
            if self.cfg.exit_when_done and self.r.exists(self.keys.done):
                self.evaluator.finish()  # the final version's evaluation round, if evaluation is on
                log.info("the learner finished the run; exiting")
                self.stop.set()  # nothing more is trained: do not wait on a broker that may be gone
                break
            try:
                self.step()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                log.warning("redis unavailable (%s); retrying", e)
                time.sleep(1.0)
        # drain: no new prompts; the batch the sink holds is scored, sent and released first
        self.state = "draining"
        self.send_heartbeat(force=True)
        if self._sink.is_alive():
            self._outbox.put(None)
            self._sink.join()
        self.state = "stopped"
        self.send_heartbeat(force=True)
        self.sender.close()
        if self._sink_error:
            raise RuntimeError(f"generator stopped after a sink failure: {self._sink_error}")
