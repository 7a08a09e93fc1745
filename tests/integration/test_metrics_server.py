"""The small /metrics + /healthz server the generator and learner use: a free port when asked for 0,
a clear error when the port is taken, 503 with the reason when unhealthy."""

import socket

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from broker.runtime.metrics import MetricsServer, labelled_registry


def test_port_zero_picks_a_free_port_and_serves_labelled_metrics():
    reg = CollectorRegistry()
    Gauge("relay_learner_step", "steps", registry=reg).set(4)
    health = {"ok": True}
    srv = MetricsServer(
        "127.0.0.1",
        0,
        labelled_registry("learner", "0", reg),
        lambda: (health["ok"], "ok" if health["ok"] else "redis unavailable: refused"),
    )
    try:
        assert srv.port > 0
        base = f"http://127.0.0.1:{srv.port}"
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(base + "/metrics").text)}
        assert fams["relay_learner_step"].samples[0].value == 4.0
        assert fams["relay_learner_step"].samples[0].labels == {"service": "learner", "replica": "0"}
        assert httpx.get(base + "/healthz").status_code == 200
        health["ok"] = False
        resp = httpx.get(base + "/healthz")
        assert resp.status_code == 503 and "redis unavailable" in resp.text
        assert httpx.get(base + "/nope").status_code == 404
    finally:
        srv.close()


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}.*metrics_port"):
            MetricsServer("127.0.0.1", port, CollectorRegistry())
