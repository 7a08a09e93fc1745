"""The broker's HTTP side: the live dashboard, its JSON API, server-sent events, ``/metrics`` and
``/healthz``. Every route is documented in docs/dashboard.md.

    GET /                        the dashboard page (broker/dashboard/static/, served from here: works offline)
    GET /api/state               the run's state now (broker/dashboard/state.py: build_state)
    GET /api/history/learner     per-step learner metrics   ?after=<stream id>&limit=<n>
    GET /api/history/events      published/applied/refused  ?after=<stream id>&limit=<n>
    GET /api/history/throughput  queue depth, groups/s      ?after=<unix time>
    GET /api/stream              server-sent events: state every push_s, new history entries as they come
    GET /api/prometheus/targets  Prometheus HTTP service discovery: every service's /metrics
    GET /metrics  /healthz

The page loads the histories once, then follows ``/api/stream``; it never reloads.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import redis
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.registry import Collector

from broker.client.telemetry import newest_id, read_heartbeats, read_services
from broker.prompts.evals import EvalHistory
from broker.protocol.keys import Keys
from broker.runtime.httpserver import BoundedHTTPServer
from broker.runtime.metrics import CONTENT_TYPE, advertised_host, render
from broker.dashboard.state import Throughput, build_state, events_history, learner_history, shown_state
from broker.protocol.signing import AnnounceVerifier

log = logging.getLogger("relay.broker.dashboard")

STATIC = Path(__file__).with_name("static")
WORKERS, STREAMS = 16, 8  # the HTTP server's worker threads; of them, the most that event streams may hold
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}


class Dashboard:
    """State, histories and the event stream of one run, for the broker's HTTP server."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        stop: threading.Event,
        dead_after_s: float = 10.0,
        push_s: float = 1.0,
        sample_s: float = 1.0,
        announce_key: AnnounceVerifier | None = None,
        eval_history: EvalHistory | None = None,
    ):
        self.r, self.keys, self.stop = r, keys, stop
        self.announce_key = announce_key
        self.dead_after_s, self.push_s = dead_after_s, push_s
        self.throughput = Throughput(r, keys, every_s=sample_s)
        # the broker passes its scheduler's history (the one that settles rounds): one reader of the results
        self.eval_history = eval_history or EvalHistory(r, keys)
        self.http = None  # the BoundedHTTPServer serving this dashboard, once serve() started it

    def start(self) -> None:
        self.throughput.start(self.stop)

    def state(self) -> dict:
        st = build_state(self.r, self.keys, self.dead_after_s, self.throughput.rates(), announce_key=self.announce_key)
        st["eval"] = self.eval_history.rounds()  # evaluation rounds so far (broker/prompts/evals.py)
        st["failures"]["malformed_records"].update(self.eval_history.malformed)  # unreadable results are skipped
        if self.http is not None:  # connections the HTTP server closed unserved (slow, oversized, evicted)
            st["http_refused"] = dict(sorted(self.http.refused.items()))
        return st

    def targets(self, self_host: str, self_port: int) -> list[dict]:
        """Prometheus HTTP SD: the broker, and every registered service whose /metrics is up."""
        out = [{"targets": [f"{self_host}:{self_port}"], "labels": {"service": "broker", "replica": "0"}}]
        heartbeats = read_heartbeats(self.r, self.keys)
        now = time.time()
        for name, s in sorted(read_services(self.r, self.keys).items()):
            if s.service == "generator":
                hb = heartbeats.get(s.replica)
                if hb is None or shown_state(hb, now, self.dead_after_s) in ("dead", "stopped"):
                    continue
            out.append({"targets": [f"{s.host}:{s.port}"], "labels": {"service": s.service, "replica": s.replica}})
        return out

    # -- server-sent events -------------------------------------------------------------------

    def stream(self, write: Callable[[bytes], None], query: dict[str, str], max_s: float = 3600.0) -> None:
        """Write SSE messages until the client goes away (``write`` raises) or the broker stops.

        ``state`` every ``push_s``; ``learner`` and ``events`` carry the history entries after the
        cursors given in the query (``learner_after``, ``events_after``: stream ids; absent = from
        now); ``throughput`` the samples after ``throughput_after`` (unix time)."""
        learner_after = query.get("learner_after")
        events_after = query.get("events_after")
        thr_after = float(query["throughput_after"]) if query.get("throughput_after") else time.time()
        write(b"retry: 2000\n\n")
        deadline = time.monotonic() + max_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                if learner_after is None:  # no cursor: from now on
                    learner_after = self._newest_id(self.keys.learner_metrics)
                if events_after is None:
                    events_after = self._newest_id(self.keys.events)
                msgs = [("state", self.state())]
                learner = learner_history(self.r, self.keys, after=learner_after, limit=500)
                if learner:
                    learner_after = learner[-1]["id"]
                    msgs.append(("learner", learner))
                events = events_history(self.r, self.keys, after=events_after, limit=1000)
                if events:
                    events_after = events[-1]["id"]
                    msgs.append(("events", events))
                thr = self.throughput.history(after=thr_after)
                if thr:
                    thr_after = thr[-1]["t"]
                    msgs.append(("throughput", thr))
            except redis.RedisError as e:  # tell the page; it shows the error and keeps listening
                msgs = [("error", {"error": f"redis unavailable: {e}"})]
            write(b"".join(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode() for kind, data in msgs))
            self.stop.wait(self.push_s)

    def _newest_id(self, stream: str) -> str:
        return newest_id(self.r, stream)


class BrokerGauges(Collector):
    """Gauges computed from Redis at scrape time (the same numbers the dashboard shows)."""

    def __init__(self, dashboard: Dashboard):
        self.dashboard = dashboard

    def describe(self):
        return []

    def collect(self):
        st = self.dashboard.state()

        def gauge(name: str, doc: str, value, label: str | None = None):
            """One gauge: ``value`` a number (None = no sample), or [(label value, number)] for ``label``."""
            g = GaugeMetricFamily(name, doc, labels=[label] if label else None)
            if label:
                for lv, v in value:
                    g.add_metric([lv], v)
            elif value is not None:
                g.add_metric([], value)
            return g

        yield gauge(
            "relay_broker_queue_groups",
            "groups in the trajectories stream (waiting or being trained on)",
            st["queue_depth"],
        )
        yield gauge(
            "relay_broker_pending_groups", "groups read by the learner and not yet acknowledged", st["pending_groups"]
        )
        yield gauge("relay_broker_prompts_ready", "prompts waiting in the prompts stream", st["prompts_ready"])
        yield gauge(
            "relay_broker_queue_bytes", "bytes of the group messages in the trajectories stream", st["queue_bytes"]
        )
        yield gauge(
            "relay_broker_ingest_insecure",
            "1 when ingest_auth = insecure: anyone who reaches the ingest can send groups",
            None if st["ingest_auth"] is None else int(st["ingest_auth"] == "insecure"),
        )
        yield gauge("relay_broker_learner_version", "the latest announced weight version", st["learner_version"])
        rates = st["rates"]
        yield gauge(
            "relay_broker_groups_in_per_second",
            "groups accepted per second (10 s window)",
            rates.get("groups_in_per_s"),
        )
        yield gauge(
            "relay_broker_groups_out_per_second",
            "groups consumed by the learner per second (10 s window)",
            rates.get("groups_out_per_s"),
        )
        gens = st["generators"]
        counts: dict[str, int] = {}
        for g in gens:
            counts[g["state"]] = counts.get(g["state"], 0) + 1
        yield gauge(
            "relay_broker_generators",
            "generators by shown state (dead = heartbeat too old)",
            sorted(counts.items()),
            "state",
        )
        yield gauge(
            "relay_broker_generator_lag_versions",
            "learner version minus the version a generator serves",
            [(g["id"], g["lag"]) for g in gens if g["lag"] is not None],
            "generator",
        )
        yield gauge(
            "relay_broker_generator_hash_mismatch",
            "1 when a generator serves a hash other than the one announced for its version",
            [(g["id"], 0 if g["hash_ok"] else 1) for g in gens],
            "generator",
        )
        done = [e for e in st.get("eval", []) if e["complete"]]
        last = done[-1] if done else {}
        yield gauge("relay_eval_rounds", "evaluation rounds completed", len(done))
        yield gauge("relay_eval_version", "weight version of the last completed evaluation round", last.get("version"))
        for key, name, doc in (
            ("pass@1", "pass_at_1", "pass@1"),
            ("pass@k", "pass_at_k", "pass@k (k = eval.samples)"),
            ("mean_reward", "mean_reward", "mean reward"),
            ("mean_length", "mean_length", "mean response length in tokens"),
        ):
            yield gauge(f"relay_eval_{name}", f"{doc} of the last completed evaluation round", last.get(key))
        yield gauge(
            "relay_broker_generator_heartbeat_age_seconds",
            "seconds since a generator's last heartbeat",
            [(g["id"], g["age_s"]) for g in gens if g["age_s"] is not None],
            "generator",
        )
        yield gauge(
            "relay_broker_malformed_heartbeats",
            "heartbeat entries that cannot be read (skipped; the broker logs why)",
            len(st["failures"]["malformed_heartbeats"]),
        )
        yield gauge(
            "relay_broker_malformed_records",
            "records in Redis that cannot be read, skipped: heartbeats, "
            "stats fields and evaluation rounds now, evaluation results since the broker started (it logs why)",
            sorted(st["failures"]["malformed_records"].items()),
            "kind",
        )
        yield gauge(
            "relay_broker_http_refused",
            "HTTP connections closed unserved since the broker started, by "
            "reason (head_timeout, head_too_large, body, evicted, busy)",
            sorted(st.get("http_refused", {}).items()),
            "reason",
        )


def serve(host: str, port: int, dashboard: Dashboard, counters: CollectorRegistry) -> BoundedHTTPServer:
    """Start the broker's HTTP server (a selector thread and a pool of workers: broker/runtime/httpserver.py);
    raises OSError naming the address. At most ``STREAMS`` event streams are open at once (each holds a
    worker); one more is answered 503, so the page's streams can never take every worker from ``/healthz``."""
    gauges = BrokerGauges(dashboard)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # access logs go to our logger at debug level
            log.debug("http: " + fmt, *args)

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, obj) -> None:
            self._send(200, json.dumps(obj).encode(), "application/json")

        def do_GET(self):
            url = urlsplit(self.path)
            path = url.path
            q = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                limit = max(1, min(int(q.get("limit", 2000)), 10000))
                if path == "/healthz":
                    dashboard.r.ping()
                    self._send(200, b"ok\n", "text/plain")
                elif path == "/metrics":
                    self._send(200, render("broker", "0", counters, gauges), CONTENT_TYPE)
                elif path == "/api/state":
                    self._json(dashboard.state())
                elif path == "/api/history/learner":
                    self._json({"entries": learner_history(dashboard.r, dashboard.keys, q.get("after"), limit)})
                elif path == "/api/history/events":
                    self._json({"entries": events_history(dashboard.r, dashboard.keys, q.get("after"), limit)})
                elif path == "/api/history/throughput":
                    after = float(q["after"]) if q.get("after") else None
                    self._json({"samples": dashboard.throughput.history(after)})
                elif path == "/api/prometheus/targets":
                    self._json(dashboard.targets(advertised_host(host), self.server.server_address[1]))
                elif path == "/api/stream":
                    self._stream(q)
                elif path in ("/", "/index.html"):
                    self._static("index.html")
                elif path.startswith("/static/"):
                    self._static(path[len("/static/") :])
                else:
                    self._send(404, b"not found (see docs/dashboard.md for the routes)\n", "text/plain")
            except ValueError as e:
                self._send(400, f"bad query: {e}\n".encode(), "text/plain")
            except redis.RedisError as e:
                self._send(503, f"redis unavailable: {e}\n".encode(), "text/plain")
            except (BrokenPipeError, ConnectionResetError):
                log.debug("client went away during %s", path)

        def _static(self, name: str) -> None:
            # only files that exist in broker/dashboard/static (no path traversal)
            files = {p.name: p for p in STATIC.iterdir() if p.is_file()}
            p = files.get(name)
            if p is None:
                self._send(404, b"not found\n", "text/plain")
            else:
                self._send(200, p.read_bytes(), _TYPES.get(p.suffix, "application/octet-stream"))

        def _stream(self, q: dict) -> None:
            if not self.server.stream_slots.acquire(blocking=False):
                self._send(503, f"too many open event streams (at most {STREAMS})\n".encode(), "text/plain")
                return
            try:
                self._stream_events(q)
            finally:
                self.server.stream_slots.release()

        def _stream_events(self, q: dict) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Accel-Buffering", "no")
            self.end_headers()

            def write(data: bytes) -> None:
                self.wfile.write(data)
                self.wfile.flush()

            dashboard.stream(write, q)

    try:
        server = BoundedHTTPServer((host, port), Handler, workers=WORKERS, stream_slots=STREAMS)
    except OSError as e:
        raise OSError(f"cannot serve HTTP on {host}:{port}: {e.strerror} (is the port in use? set http_port)") from None
    dashboard.http = server  # its refusals are counted in /metrics
    server.start()
    dashboard.start()
    log.info("dashboard on http://%s:%d/", host, server.server_address[1])
    return server
