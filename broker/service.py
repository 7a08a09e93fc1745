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
from broker.prompts.evals import EvalScheduler
from broker.protocol.keys import Keys
from broker.runtime.httpserver import BoundedHTTPServer
from broker.protocol.signing import announce_key

log = logging.getLogger("relay.broker")


class Broker:
    def __init__(self, cfg: BrokerConfig):
        self.cfg = cfg
        self.keys = Keys(cfg.run_id)
        # the key that tells the learner's announcements from forged ones (None: announce_auth insecure)
        self.announce_key = announce_key(cfg.announce_auth, cfg.announce_key_file)
        self.r = connect_redis(cfg.redis_url)
        self.stop_event = threading.Event()
        self.registry = CollectorRegistry()  # counters; gauges come from Redis at scrape time (dashboard/server.py)
        self.ingest = Ingest(self.r, self.keys, cfg, self.registry, self.announce_key)
        self.feeder = PromptFeeder(self.r, self.keys, cfg, self.registry, self.announce_key)
        self.evals = EvalScheduler(self.r, self.keys, cfg.eval, self.feeder.eval_source,
                                   announce_key=self.announce_key)
        self.dashboard = dashboard.Dashboard(self.r, self.keys, self.stop_event, cfg.dead_after_s,
                                             cfg.dashboard_push_s, announce_key=self.announce_key)
        queues.ensure_groups(self.r, self.keys)
        advertise_run(self.r, self.keys, ingest_address=cfg.advertised_ingest(), ingest_auth=cfg.ingest_auth)  # how producers reach the ingest

    def run(self) -> None:
        sock = self.ingest.bind()
        while not self.stop_event.is_set():
            try:
                self.feeder.feed()
                self.evals.tick()
                if sock.poll(100):
                    self.ingest.serve_waiting(sock)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                # No ack is sent: the generator keeps the group and resends once Redis is back.
                log.warning("redis unavailable (%s); retrying", e)
                time.sleep(0.5)
        self.ingest.close(sock)

    def serve_http(self) -> BoundedHTTPServer:
        """The dashboard, its API, /metrics and /healthz on ``http_host:http_port`` (a thread)."""
        return dashboard.serve(self.cfg.http_host, self.cfg.http_port, self.dashboard, self.registry)
