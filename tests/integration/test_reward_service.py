"""The reward service as a real HTTP server process."""

import httpx

from deploy.launcher.procs import free_port
from tests.support.services import start_service, wait_http
from tests.support.services import metric_value


def test_batch_scoring_over_http_keeps_order_and_reports_failures(procs, tmp_path):
    port = free_port()
    child = start_service(procs, "reward", "reward", {"port": port}, tmp_path)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/healthz", child)
    items = [
        {"prompt": "12=", "completion": "12", "reference": "12", "task": "copy"},
        {"prompt": "12=", "completion": "21", "reference": "21", "task": "reverse"},
        {"prompt": "12=", "completion": "1", "reference": "12", "task": "copy", "finished": False},
        {"prompt": "x", "completion": "y", "reference": "y", "task": "no_such_task"},
        {"prompt": "x", "completion": "y", "reference": "y", "task": "exact_match"},
    ]
    res = httpx.post(f"{base}/score", json={"items": items}).json()["results"]
    assert [r["score"] for r in res] == [1.0, 1.0, 0.0, None, 1.0]
    assert res[3]["status"] == "failed" and res[3]["reason"] == "unknown_plugin"
    assert res[0]["plugin"] == "digits" and res[4]["plugin"] == "exact_match"
    bad = httpx.post(f"{base}/score", json={"items": [{"completion": 3}]})
    assert bad.status_code == 422  # malformed request: a clear client error, not a 500
    metrics = httpx.get(f"{base}/metrics").text
    assert (
        metric_value(
            metrics, "relay_reward_items_total", plugin="no_such_task", reason="unknown_plugin", status="failed"
        )
        == 1.0
    )
    assert "digits" in httpx.get(f"{base}/plugins").json()["plugins"]
