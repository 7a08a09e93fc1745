"""Prometheus exposition shared by every service: one naming scheme, the same two labels, and a
small HTTP server for the services that have no web framework of their own (generator, learner).

Naming: ``relay_<service>_<what>[_<unit>]``, counters end in ``_total``. Every sample of every
service carries the labels ``service`` (broker, reward, generator, learner) and ``replica`` (the
replica id: the generator id, ``0`` for the singletons). The labels are added here, when the text
is rendered, so a metric definition never repeats them. Every name is listed in
``docs/dashboard.md`` (a test checks it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.client.connection import connect_host
from broker.runtime.httpserver import BoundedHTTPServer

log = logging.getLogger("relay.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _WithServiceLabels(Collector):
    """Every sample of ``inner`` with ``service`` and ``replica`` labels added, plus
    ``relay_service_info{service, replica} 1`` so each process is visible even before it counts anything."""

    def __init__(self, inner: Iterable[Collector], service: str, replica: str):
        self.inner = list(inner)
        self.service, self.replica = service, replica

    def describe(self):  # names are only known at scrape time; nothing to check at registration
        return []

    def collect(self):
        base = {"service": self.service, "replica": self.replica}
        info = GaugeMetricFamily(
            "relay_service_info", "one sample per Relay process: its service and replica id", labels=list(base)
        )
        info.add_metric(list(base.values()), 1)
        yield info
        for collector in self.inner:
            for fam in collector.collect():
                out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    if s.name.endswith("_created"):  # creation-time series: noise on every counter, left out
                        continue
                    out.add_sample(s.name, {**base, **s.labels}, s.value, s.timestamp, s.exemplar)
                yield out


def labelled_registry(service: str, replica: str, *inner: Collector) -> CollectorRegistry:
    """A registry that renders ``inner`` (registries or collectors) with the service labels."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_WithServiceLabels(inner, service, replica))
    return reg


def render(service: str, replica: str, *inner: Collector) -> bytes:
    """Prometheus text for ``inner`` with the service labels (for servers that render on demand)."""
    return generate_latest(labelled_registry(service, replica, *inner))


def advertised_host(bind_host: str) -> str:
    """The host other machines should scrape: the bind address, or this host's name for 0.0.0.0/::."""
    return connect_host(bind_host)


class MetricsServer:
    """``GET /metrics`` (Prometheus text) and ``GET /healthz`` on ``host:port``: a bounded server
    (broker/runtime/httpserver.py: a few workers, a deadline on each request's head).

    ``port`` 0 picks a free port; the chosen one is ``self.port`` (services report it in their
    heartbeat or stats so tools can find it). ``healthy`` returns ``(ok, detail)``; a failing
    check answers 503 with the detail. A bind failure raises ``OSError`` naming the address.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        healthy: Callable[[], tuple[bool, str]] = lambda: (True, "ok"),
    ):
        reg, check = registry, healthy

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):
                log.debug("http: " + fmt, *args)

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/metrics":
                    self._send(200, generate_latest(reg), CONTENT_TYPE)
                elif path == "/healthz":
                    ok, detail = check()
                    self._send(200 if ok else 503, (detail + "\n").encode(), "text/plain")
                else:
                    self._send(404, b"not found (try /metrics or /healthz)\n", "text/plain")

        try:
            self.server = BoundedHTTPServer((host, port), Handler, workers=4, max_connections=64)
        except OSError as e:
            raise OSError(
                f"cannot serve metrics on {host}:{port}: {e.strerror} (set metrics_port; 0 picks a free one)"
            ) from None
        self.host = host
        self.port: int = self.server.server_address[1]
        self.server.start("metrics-http")
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
