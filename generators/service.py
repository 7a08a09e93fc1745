"""The generator service loop: claim prompts -> sample groups -> hand them to the sink (score ->
send -> release the prompts: generators/sink.py).

With ``env`` set, each sample is a multi-turn episode run by :class:`generators.episodes.EpisodeRunner`
(the environment's replies between the model's turns; newer weights may be applied between turns);
staleness admission still counts prompts, one group per prompt, one sample per episode.

Between batches it applies any newer announced weight version in place (generators/weights.py). A
prompt is acknowledged (XACK + XDEL) only after the broker confirmed its group is in Redis, so a
generator that dies loses nothing: its pending prompts are reclaimed by another generator after
``claim_idle_s``; a live one renews what it holds meanwhile (generators/leases.py).
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
import zlib

import redis

from broker.client import queues
from broker.client.announcements import advertise_run
from broker.client.connection import connect_redis
from broker.client.telemetry import emit_event, heartbeat
from broker.protocol.keys import Keys
from broker.protocol.messages import PromptEntry
from broker.protocol.signing import announce_verifier
from broker.protocol.weightauth import weights_key
from broker.runtime.config import ConfigError
from generators.config import GeneratorConfig
from generators.episodes import Episodes
from generators.eval import EvalContext, Evaluator
from generators.heartbeats import Progress, heartbeat_message
from generators.leases import Leases
from generators.liveness import ComputeWatch, DecodeHook, GenerationStopped
from generators.metrics import MetricSources, serve_metrics
from generators.prompts import prompt_token_ids
from generators.reward_client import RewardClient
from generators.sink import Batch, Sink, sender_keys
from generators.transports import ReceiverContext, build_receiving
from generators.weights import WeightApplier

log = logging.getLogger("relay.generator")


def advertise(r: redis.Redis, keys: Keys, cfg: GeneratorConfig) -> None:
    """The run's advertisement: the first generator's reward URL and sampling are the run's; a generator that
    samples otherwise says so (the learner drops its groups)."""
    run = advertise_run(r, keys, first_writer_wins=True, reward_url=cfg.reward.url, sampling=cfg.sampling.model_dump())
    if "sampling" in run:
        log.error(
            "this generator samples with %s but the run advertises %s: the learner drops groups whose "
            "sampling differs from its batch's (docs/protocol.md 3.4)",
            cfg.sampling.model_dump(),
            run["sampling"],
        )


class Generator:
    def __init__(self, cfg: GeneratorConfig):
        self.cfg = cfg
        self.keys = Keys(cfg.run_id)
        curve = sender_keys(cfg)  # before the backend loads its model: a missing key file fails at once
        key = announce_verifier(cfg.announce_auth, cfg.announce_public_key_file)  # a bad key file fails here, first
        wkey = weights_key(cfg.weights.auth, cfg.weights.key_file, cfg.weights.transport)  # a listener
        self.r = connect_redis(cfg.redis_url)
        self.leases = Leases(self.r, cfg.id, cfg.claim_idle_s)  # the prompts it holds, renewed while it holds them
        self.backend = cfg.backend.build()
        # the engine is not thread-safe: its weight updates and every generate (this loop, evaluation, episodes,
        # the OpenAI endpoint) hold this lock; re-entrant, as "continue" updates weights inside generate
        self.engine_lock = threading.RLock()
        # a heartbeat (at most one per heartbeat_s) from every engine/decode step: a batch that decodes for
        # minutes on a slow machine is busy, not hung (relay up's --hang-after watches heartbeats); a single
        # step of minutes is covered by the ComputeWatch started in run()
        self.stop = threading.Event()
        # ... and a batch still generating STOP_GRACE_S after a stop is abandoned (generators/liveness.py)
        self.backend.alive = DecodeHook(self.send_heartbeat, self.stop)
        self.progress = Progress()  # its state and tokens: reported by heartbeats and /metrics
        self._last_hb = 0.0
        # multi-turn episodes: the environment is built (its options checked) now; the runner once the
        # model (and its tokenizer, which renders the environment's replies) is loaded
        self.episodes = Episodes(cfg, self.backend, self._between_turns, self.engine_lock) if cfg.episodes.env else None
        self._batch = 0
        # weights.transport: how versions arrive beside the store (generators/transports.py)
        receiving = build_receiving(ReceiverContext(cfg, self.r, self.keys, self.backend, key, wkey))
        self.weights = WeightApplier(
            self.r,
            self.keys,
            self.backend,
            cfg.id,
            self._report,
            self.stop.is_set,
            key,
            cfg.weight_store,
            receiving.fetcher,
            receiver=receiving.tensors,
            hash_threads=cfg.weights.hash_threads,
            engine_lock=self.engine_lock,
        )
        self.rewards = RewardClient(cfg, self.stop.is_set)
        hash_for = self.weights.hash_for if self.weights.receiver is not None else None
        self.sink = Sink(
            cfg,
            self.r,
            self.keys,
            self.rewards,
            self.backend.decode,
            self.stop,
            self.send_heartbeat,
            curve,
            hash_for,
            self.leases,
        )
        # /metrics and /healthz; its port goes into every heartbeat
        training_episodes = self.episodes.stats if self.episodes is not None else None
        sources = MetricSources(self.progress, self.weights, self.sink, self.leases, training_episodes)
        self.metrics = serve_metrics(self.r, self.keys, cfg.metrics.host, cfg.metrics.port, cfg.id, sources)
        self.evaluator = Evaluator(self._eval_context())  # held-out rounds, between training batches (docs/eval.md)
        # -- issue 20 hook: the OpenAI-compatible endpoint for external agent harnesses (off by default)
        self.openai = self._start_openai(hash_for) if cfg.openai.enabled else None
        if self.openai is not None:
            sources.more.append(self.openai.collect)
        advertise(self.r, self.keys, cfg)

    def _eval_context(self) -> EvalContext:
        """What evaluation uses of this generator (generators/eval.py)."""
        return EvalContext(
            r=self.r,
            keys=self.keys,
            cfg=self.cfg,
            backend=self.backend,
            engine_lock=self.engine_lock,
            weights=self.weights,
            leases=self.leases,
            score_groups=self.rewards.score_groups,
            heartbeat=self.send_heartbeat,
            stop=self.stop,
            episode_runner=self.episodes.runner if self.episodes is not None else None,
        )

    def _start_openai(self, hash_for):
        """Serve the OpenAI-compatible endpoint (generators/openai_server.py) with what it uses of this generator."""
        from generators.openai_endpoint import EndpointContext
        from generators.openai_server import start

        c, w = self.cfg, self.weights
        return start(
            EndpointContext(
                cfg=c.openai,
                sampling=c.sampling,
                seed=c.seed,
                generator_id=c.id,
                run_id=c.run_id,
                backend=self.backend,
                engine_lock=self.engine_lock,
                served=lambda: (w.version, w.hash),
                hash_for=hash_for,
                count_tokens=self.progress.add_tokens,
                send_group=self.sink.send_group,
                score=self.rewards.score,
                stop=self.stop,
                emit=functools.partial(emit_event, self.r, self.keys),
            )
        )

    # -- state and heartbeats -------------------------------------------------------------------

    def _report(self, state: str, heartbeat_now: bool) -> None:
        self.progress.state = state
        if heartbeat_now:
            self.send_heartbeat(force=True)

    def send_heartbeat(self, force: bool = False) -> None:
        self.leases.renew()  # every claim_idle_s / 3: the prompts held are not taken over while this one works
        now = time.monotonic()
        if not force and now - self._last_hb < self.cfg.heartbeat_s:
            return
        self._last_hb = now
        stats = self.episodes.stats if self.episodes is not None else None  # where the schema has the field
        c = self.cfg
        hb = heartbeat_message(
            c.id, c.in_flight, self.backend, self.weights, self.sink, self.progress, self.metrics.port, stats
        )
        heartbeat(self.r, self.keys, hb)

    # -- prompts --------------------------------------------------------------------------------

    def claim(self) -> list[tuple[bytes, PromptEntry]]:
        """Claim up to prompts_per_batch prompts: first ones abandoned by dead generators (already
        admitted), then new ones as far as staleness admission control allows."""
        n = self.cfg.prompts_per_batch
        out = queues.claim_abandoned(self.r, self.keys.prompts, self.cfg.id, self.cfg.claim_idle_s, n)
        want = n - len(out)
        # admission and the read in one script: a generator killed at any moment leaks no grant (with
        # η = 0 a leaked one would leave the learner waiting for groups nobody may produce)
        granted, got = queues.admit_and_claim(self.r, self.keys, self.cfg.id, want) if want else (0, [])
        if want and not granted and not out:
            self.progress.state = "paused_staleness"
            self.send_heartbeat()
            time.sleep(0.02)
            return []
        out.extend(got)
        self.leases.hold(self.keys.prompts, [eid for eid, _ in out])
        if not out:
            self.progress.state = "waiting_for_prompts"
            self.send_heartbeat()
            time.sleep(0.05)  # the feeder tops the stream up; look again shortly
        return out

    # -- main loop ------------------------------------------------------------------------------
    #
    # Two threads: this one claims prompts and keeps the engine generating; the sink (sink.py)
    # scores, sends and releases the previous batch meanwhile.

    def _on_step(self) -> int:
        """In-flight "continue": between two decode steps, load a newer version if one is announced."""
        self.weights.update()
        return self.weights.version

    def _between_turns(self) -> int | None:
        """Between an episode's turns: apply a newer announced version, if any; the version serving now."""
        self.weights.update()
        return self.weights.version

    def step(self) -> bool:
        """Generate one batch and hand it to the sink. Returns False when there was nothing to do."""
        self.weights.update()
        self.evaluator.serve()  # waiting held-out prompts first (a few per round, every N versions)
        claimed = self.claim()  # sets (and reports) paused_staleness while admission is closed
        if not claimed:
            return False
        self.progress.state = "sampling"
        self.send_heartbeat()
        prompts = [f for _, f in claimed]
        version, whash = self.weights.version, self.weights.hash
        t0 = time.monotonic()
        self._batch += 1
        seed = zlib.crc32(f"{self.cfg.seed}:{self.cfg.id}:{self._batch}".encode())
        on_step = self._on_step if self.cfg.in_flight == "continue" else None
        if self.cfg.episodes.env:  # multi-turn episodes, one per sample
            runner = self.episodes.runner()
            ids = [runner.prompt_ids(p) for p in prompts]
            groups = runner.run(prompts, ids, seed, on_step=on_step)
        else:
            ids = [prompt_token_ids(p, self.backend.encode) for p in prompts]  # the feeder's ids when it sent them
            with self.engine_lock:
                groups = self.backend.generate(ids, self.cfg.sampling, seed=seed, on_step=on_step)
        # tokens the model sampled (an episode's context tokens, its environment's replies, not counted)
        ntok = sum(sum(c.trainable) if c.trainable is not None else len(c.token_ids) for cs in groups for c in cs)
        self.progress.batch_done(t0, sum(len(cs) for cs in groups), ntok, (version, self.weights.version))
        batch = Batch(claimed, ids, groups, version, whash, time.time())
        while True:  # blocks while the sink still holds a batch: back-pressure reaches generation here
            if not self.sink.alive():
                if self.stop.is_set():  # it failed and asked to stop: run() drains, reports and exits
                    return True  # this batch's prompts stay pending and are reclaimed
                raise RuntimeError(f"the sink thread died: {self.sink.error}")
            if self.sink.offer(batch, timeout_s=0.5):
                break
            self.weights.update()  # meanwhile keep the weights current: the next batch starts from them
            self.send_heartbeat()
        return True

    def run(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        self.sink.check_ingest_key()
        self.sink.start()
        # heartbeats while one engine step computes for longer than --hang-after (generators/liveness.py)
        watch = ComputeWatch(threading.current_thread(), self.send_heartbeat, self.cfg.heartbeat_s, self.stop)
        watch.start()
        self.weights.update(block=True)
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
            except GenerationStopped as e:
                log.warning("%s", e)
                break
        watch.join(self.cfg.heartbeat_s + 5)  # stopped with the loop: its heartbeats cannot follow "stopped"
        # drain: no new prompts; the batch the sink holds is scored, sent and released first
        self.progress.state = "draining"
        self.send_heartbeat(force=True)
        self.sink.drain()
        self.progress.state = "stopped"
        self.send_heartbeat(force=True)
        self.sink.close()
        self.rewards.close()
        if self.episodes is not None:
            self.episodes.close()  # the runner, and what the environment's episodes share
        if self.weights.receiver is not None:
            self.weights.receiver.close()
        if hasattr(self.backend, "close"):
            self.backend.close()  # an engine server the backend started (the sglang backend's launch.python)
        if isinstance(self.sink.failure, ConfigError):
            raise self.sink.failure  # the reward service refused this generator: relay generator exits 2 with why
        if self.sink.error:
            raise RuntimeError(f"generator stopped after a sink failure: {self.sink.error}")
