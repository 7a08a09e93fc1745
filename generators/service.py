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

import logging
import signal
import threading
import time
import zlib

import redis

from broker.client import queues
from broker.client.announcements import advertise_run
from broker.client.connection import connect_redis
from broker.client.telemetry import heartbeat
from broker.protocol.keys import Keys
from broker.protocol.messages import Heartbeat, PromptEntry
from broker.protocol.signing import announce_verifier
from broker.protocol.weightauth import weights_key
from broker.runtime.config import ConfigError
from generators.config import GeneratorConfig
from generators.episodes import EpisodeLimits, EpisodeRunner, EpisodeStats
from generators.eval import Evaluator
from generators.leases import Leases
from generators.liveness import ComputeWatch, DecodeHook, GenerationStopped
from generators.metrics import serve_metrics
from generators.prompts import prompt_token_ids
from generators.reward_client import RewardClient
from generators.sink import Batch, Sink, sender_keys
from generators.transports import ReceiverContext, build_receiving
from generators.weights import WeightApplier

log = logging.getLogger("relay.generator")


class Generator:
    def __init__(self, cfg: GeneratorConfig):
        self.cfg = cfg
        self.keys = Keys(cfg.run_id)
        curve = sender_keys(cfg)  # before the backend loads its model: a missing key file fails at once
        key = announce_verifier(cfg.announce_auth, cfg.announce_public_key_file)  # a bad key file fails here, first
        wkey = weights_key(cfg.weights.auth, cfg.weights.key_file, cfg.weights.transport)  # http, collective
        self.r = connect_redis(cfg.redis_url)
        self.leases = Leases(self.r, cfg.id, cfg.claim_idle_s)  # the prompts it holds, renewed while it holds them
        self.backend = cfg.backend.build()
        # a heartbeat (at most one per heartbeat_s) from every engine/decode step: a batch that decodes for
        # minutes on a slow machine is busy, not hung (relay up's --hang-after watches heartbeats); a single
        # step of minutes is covered by the ComputeWatch started in run()
        self.stop = threading.Event()
        # ... and a batch still generating STOP_GRACE_S after a stop is abandoned (generators/liveness.py)
        self.backend.alive = DecodeHook(self.send_heartbeat, self.stop)
        self.state = "starting"
        self.tokens = 0
        self.tokens_per_s = 0.0
        self._last_hb = 0.0
        # multi-turn episodes: the environment is built (its options checked) now; the runner once the
        # model (and its tokenizer, which renders the environment's replies) is loaded
        self.episode_stats = EpisodeStats()
        self.env_factory = None
        self.runner: EpisodeRunner | None = None
        if cfg.episodes.env:
            from generators.envs.registry import build_env

            self.env_factory = build_env(cfg.episodes.env, cfg.episodes.env_options)
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
        )
        self.rewards = RewardClient(cfg, self.stop.is_set)
        self.sink = Sink(
            cfg,
            self.r,
            self.keys,
            self.rewards,
            self.backend.decode,
            self.stop,
            self.send_heartbeat,
            curve,
            self.weights.hash_for if self.weights.receiver is not None else None,
            self.leases,
        )
        self.metrics = serve_metrics(self)  # /metrics and /healthz; its port goes into every heartbeat
        self.evaluator = Evaluator(self)  # held-out evaluation rounds, between training batches (docs/eval.md)
        # -- issue 20 hook: the OpenAI-compatible endpoint for external agent harnesses (off by default;
        # generators/openai_server.py: it also puts one lock around the engine's generate and weight updates)
        self.openai = None
        if cfg.openai.enabled:
            from generators.openai_server import start as start_openai

            self.openai = start_openai(self)
        # the run's advertisement: the first generator's reward URL and sampling are the run's
        run = advertise_run(
            self.r, self.keys, first_writer_wins=True, reward_url=cfg.reward.url, sampling=cfg.sampling.model_dump()
        )
        if "sampling" in run:
            log.error(
                "this generator samples with %s but the run advertises %s: the learner drops groups whose "
                "sampling differs from its batch's (docs/protocol.md 3.4)",
                cfg.sampling.model_dump(),
                run["sampling"],
            )

    def _check_ingest_key(self, timeout_s: float = 5.0) -> None:
        """With CURVE, learn at once whether the broker admits this generator's key (GroupSender.wait_connected)
        rather than time out on every group: a refused key, or a broker without CURVE, stops the generator
        with the reason (exit 2; no retry can fix it). A broker not answering yet is only logged: the groups
        wait for it as they always do."""
        if self.sink.sender.curve is None:
            return
        try:
            self.sink.sender.wait_connected(timeout_s)
        except (PermissionError, ConnectionError) as e:  # the sink's thread has not started: its socket is ours
            log.error("the broker's ingest refuses this generator: %s", e)
            raise SystemExit(2) from None
        except TimeoutError as e:
            log.warning("%s; the groups wait until it answers", e)

    # -- state and heartbeats -------------------------------------------------------------------

    def _report(self, state: str, heartbeat_now: bool) -> None:
        self.state = state
        if heartbeat_now:
            self.send_heartbeat(force=True)

    def send_heartbeat(self, force: bool = False) -> None:
        self.leases.renew()  # every claim_idle_s / 3: the prompts held are not taken over while this one works
        now = time.monotonic()
        if not force and now - self._last_hb < self.cfg.heartbeat_s:
            return
        self._last_hb = now
        w, sink = self.weights, self.sink
        heartbeat(
            self.r,
            self.keys,
            Heartbeat(
                id=self.cfg.id,
                backend=self.backend.name,
                version=w.version,
                # a version applied via the collective: its announced hash as soon as it is announced
                hash=w.hash
                or (w.hash_for(w.version, wait_s=0) if w.receiver is not None and w.version is not None else ""),
                # back-pressure on the sink shows even while the engine is busy generating
                state=sink.state if sink.state in ("paused_backpressure", "paused_reward") else self.state,
                sink_state=sink.state,
                in_flight=self.cfg.in_flight,
                engine=self.backend.engine_info()
                if w.version is not None and hasattr(self.backend, "engine_info")
                else {},
                tokens_per_s=round(self.tokens_per_s, 1),
                refused=dict(list(w.refused.items())[-3:]),
                metrics_port=self.metrics.port,
                groups_sent=sink.groups_sent,
                groups_rejected=sink.groups_rejected,
                tokens=self.tokens,
                updates=w.updates,
                refused_updates=w.refused_updates,
                forged_announcements=w.forged_announcements,
                **sink.scored.fields(),
                last_update_latency_s=w.last_update_latency_s,
                # the episodes' counters (turns, tool calls and failures by tool, env latency, template drift),
                # where the heartbeat's schema has the field
                **({"episodes": self.episode_stats.snapshot()} if self.cfg.episodes.env else {}),
            ),
        )

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
            self.state = "paused_staleness"
            self.send_heartbeat()
            time.sleep(0.02)
            return []
        out.extend(got)
        self.leases.hold(self.keys.prompts, [eid for eid, _ in out])
        if not out:
            self.state = "waiting_for_prompts"
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

    def _episode_runner(self) -> EpisodeRunner:
        if self.runner is None:  # the model is loaded by now: its tokenizer renders the environment's replies
            from generators.episodes import check_tool_vocabulary, make_renderer

            renderer = make_renderer(self.backend)
            check_tool_vocabulary(renderer, self.backend)
            c = self.cfg
            self.runner = EpisodeRunner(
                self.backend,
                self.env_factory,
                c.sampling,
                EpisodeLimits(c.episodes.max_turns, c.episodes.max_tokens, c.episodes.timeout_s),
                self._between_turns,
                renderer,
                threads=c.episodes.env_threads,
                stats=self.episode_stats,
                env_name=c.episodes.env,
            )
        return self.runner

    def step(self) -> bool:
        """Generate one batch and hand it to the sink. Returns False when there was nothing to do."""
        self.weights.update()
        self.evaluator.serve()  # waiting held-out prompts first (a few per round, every N versions)
        claimed = self.claim()  # sets (and reports) paused_staleness while admission is closed
        if not claimed:
            return False
        self.state = "sampling"
        self.send_heartbeat()
        prompts = [f for _, f in claimed]
        version, whash = self.weights.version, self.weights.hash
        t0 = time.monotonic()
        self._batch += 1
        seed = zlib.crc32(f"{self.cfg.seed}:{self.cfg.id}:{self._batch}".encode())
        on_step = self._on_step if self.cfg.in_flight == "continue" else None
        if self.cfg.episodes.env:  # multi-turn episodes, one per sample
            runner = self._episode_runner()
            ids = [runner.prompt_ids(p) for p in prompts]
            groups = runner.run(prompts, ids, seed, on_step=on_step)
        else:
            ids = [prompt_token_ids(p, self.backend.encode) for p in prompts]  # the feeder's ids when it sent them
            groups = self.backend.generate(ids, self.cfg.sampling, seed=seed, on_step=on_step)
        # tokens the model sampled (an episode's context tokens, its environment's replies, not counted)
        ntok = sum(sum(c.trainable) if c.trainable is not None else len(c.token_ids) for cs in groups for c in cs)
        self.tokens_per_s = ntok / max(time.monotonic() - t0, 1e-9)
        self.tokens += ntok
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
        self._check_ingest_key()
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
        self.state = "draining"
        self.send_heartbeat(force=True)
        self.sink.drain()
        self.state = "stopped"
        self.send_heartbeat(force=True)
        self.sink.close()
        self.rewards.close()
        if self.runner is not None:
            self.runner.close()
        if self.env_factory is not None and hasattr(self.env_factory, "close"):
            self.env_factory.close()  # what the environment's episodes share (a tool pool, an HTTP client)
        if self.weights.receiver is not None:
            self.weights.receiver.close()
        if isinstance(self.sink.failure, ConfigError):
            raise self.sink.failure  # the reward service refused this generator: relay generator exits 2 with why
        if self.sink.error:
            raise RuntimeError(f"generator stopped after a sink failure: {self.sink.error}")
