"""The broker process: the ingest (broker/ingest.py), the prompt feeder (broker/feeder.py), evaluation
rounds (broker/prompts/evals.py), and the HTTP server (the live dashboard and its API, ``/healthz``,
``/metrics``: broker/dashboard/server.py), all over the run's Redis.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from prometheus_client import CollectorRegistry

from broker.client import queues
from broker.client.announcements import advertise_run
from broker.client.connection import connect_redis
from broker.config import BrokerConfig
from broker.dashboard import server as dashboard
from broker.feeder import PromptFeeder
from broker.ingest import Ingest
from broker.ingest_workers import Workers
from broker.prompts.evals import EvalScheduler
from broker.protocol.keys import EVENTS_MAX, Keys
from broker.runtime.heap import freeze_startup_objects
from broker.runtime.httpserver import BoundedHTTPServer
from broker.protocol.signing import announce_verifier

log = logging.getLogger("relay.broker")


class Broker:
    def __init__(self, cfg: BrokerConfig, log_json: bool = False):
        self.cfg = cfg
        self.log_json = log_json  # the ingest workers log as the broker does
        self.keys = Keys(cfg.run_id)
        # the key that tells the learner's announcements from forged ones (None: announce_auth insecure)
        self.announce_key = announce_verifier(cfg.announce_auth, cfg.announce_public_key_file)
        self.r = connect_redis(cfg.redis_url)
        self.stop_event = threading.Event()
        self._events_trimmed_at = float("-inf")
        self.registry = CollectorRegistry()  # counters; gauges come from Redis at scrape time (dashboard/server.py)
        self.ingest = Ingest(self.r, self.keys, cfg, self.registry, self.announce_key)
        self.feeder = PromptFeeder(self.r, self.keys, cfg, self.registry, self.announce_key)
        self.evals = EvalScheduler(self.r, self.keys, cfg.eval, self.feeder.eval_source, announce_key=self.announce_key)
        self.dashboard = dashboard.Dashboard(
            self.r,
            self.keys,
            self.stop_event,
            cfg.dead_after_s,
            cfg.dashboard_push_s,
            announce_key=self.announce_key,
            eval_history=self.evals.history,
        )
        queues.ensure_groups(self.r, self.keys)
        advertise_run(
            self.r,
            self.keys,
            ingest_address=cfg.advertised_ingest(),  # how producers reach the ingest
            ingest_addresses=",".join(cfg.advertised_ingests()),
            ingest_auth=cfg.ingest_auth,
        )
        # set up: what lives now lives as long as the broker (broker/runtime/heap.py); done before the HTTP
        # server answers /healthz, so the loop starts as soon as the broker says it is up
        freeze_startup_objects()

    def run(self) -> None:
        sock = self.ingest.bind()  # ingest worker 0; workers 1..N-1 are processes of their own
        workers = Workers(self.cfg, self.r, self.keys, self.log_json).start()
        try:
            while not self.stop_event.is_set():
                try:
                    self.feeder.feed()
                    self.evals.tick()
                    self.evals.settle()
                    self._trim_events()
                    workers.check()
                    self.ingest.serve(sock, 100)
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    # No ack is sent: the generator keeps the group and resends once Redis is back.
                    log.warning("redis unavailable (%s); retrying", e)
                    time.sleep(0.5)
        finally:
            workers.stop()
            self.ingest.close(sock)

    def _trim_events(self) -> None:
        """The events stream trimmed to about ``events_kept`` entries, once a second (its writers cap it
        at EVENTS_MAX themselves)."""
        now = time.monotonic()
        if self.cfg.events_kept < EVENTS_MAX and now - self._events_trimmed_at >= 1.0:
            self._events_trimmed_at = now
            self.r.xtrim(self.keys.events, maxlen=self.cfg.events_kept, approximate=True)

    def serve_http(self) -> BoundedHTTPServer:
        """The dashboard, its API, /metrics and /healthz on ``http_host:http_port`` (a thread)."""
        return dashboard.serve(self.cfg.http_host, self.cfg.http_port, self.dashboard, self.registry)
