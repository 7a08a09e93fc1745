"""The dashboard flags what a glance must catch, with real processes: a generator serving a stale
hash for its version (red in the page, `hash_ok: false` in /api/state, a metric, `relay status
--check`), a generator paused by back-pressure, reward failures by plugin, and a generator that
died without a word."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families

from broker.client.telemetry import read_stats
from broker.protocol.keys import Keys
from deploy.launcher.procs import free_port
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.support.services import announce_key, relay, start_service, wait_http, wait_until
from tests.support.browser import browser, screenshot  # noqa: F401  (browser is a fixture)

pytestmark = pytest.mark.slow  # a run of several services: left to `make test` (docs/testing.md)


def _gen_cfg(gid: str, redis_url: str, ingest: int, reward: int) -> dict:
    return {
        "id": gid,
        "run_id": "f",
        "redis_url": redis_url,
        "broker_address": f"tcp://127.0.0.1:{ingest}",
        "reward_url": f"http://127.0.0.1:{reward}",
        "prompts_per_batch": 1,
        "sampling": {"n": 2, "max_tokens": 4},
        "heartbeat_s": 0.5,
    }


def test_stale_hash_backpressure_and_death_are_flagged(procs, redis_url, tmp_path, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ingest, http, reward = free_port(), free_port(), free_port()
    b = start_service(
        procs,
        "broker",
        "broker",
        {
            "run_id": "f",
            "redis_url": redis_url,
            "http_port": http,
            "ingest_bind": f"tcp://127.0.0.1:{ingest}",
            "prompt_backlog": 8,
            "max_queue_groups": 3,
            "dead_after_s": 3,
            "dashboard_push_s": 0.5,
        },
        tmp_path,
    )
    rw = start_service(procs, "reward", "reward", {"port": reward}, tmp_path)
    url = f"http://127.0.0.1:{http}"
    wait_http(f"{url}/healthz", b)
    wait_http(f"http://127.0.0.1:{reward}/healthz", rw)
    r, keys = redis.Redis.from_url(redis_url), Keys("f")
    state = lambda: httpx.get(f"{url}/api/state", timeout=10).json()  # noqa: E731
    gens = lambda: {g["id"]: g for g in state()["generators"]}  # noqa: E731

    # the learner's side: versions 0 and 1 published as usual
    path = build_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    pub = Publisher(r, keys, str(tmp_path / "weights"), tok, keep_versions=10, announce_key=announce_key(tmp_path))
    pub.publish(model, model.state_dict(), 0)
    a1 = pub.publish(model, model.state_dict(), 1)
    start_service(procs, "gen-a", "generator", _gen_cfg("gen-a", redis_url, ingest, reward), tmp_path)
    wait_until(lambda: (g := gens().get("gen-a")) and g["version"] == 1, 120, "gen-a serving version 1")

    # version 1 announced again with other weights (say, a learner restarted from an older
    # checkpoint): gen-a keeps the weights it has under the same version number, a stale hash
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    a1b = Publisher(
        r, keys, str(tmp_path / "weights-b"), tok, keep_versions=10, announce_key=announce_key(tmp_path)
    ).publish(model, model.state_dict(), 1)
    assert a1b.hash != a1.hash
    # gen-b also cannot reach its reward service and does not hold its batches through the outage
    # (reward_outage_hold_s 0): its samples are marked failed, counted by "plugin"
    cfg_b = dict(
        _gen_cfg("gen-b", redis_url, ingest, free_port()),
        reward_retries=0,
        reward_timeout_s=2,
        reward_down_s=0,
        reward_outage_hold_s=0,
    )
    start_service(procs, "gen-b", "generator", cfg_b, tmp_path)
    g = wait_until(lambda: (g := gens()) and g.get("gen-b", {}).get("version") == 1 and g, 120, "gen-b serving v1")

    a, bb = g["gen-a"], g["gen-b"]
    assert a["version"] == 1 and a["hash"] == a1.hash and a["announced_hash"] == a1b.hash and a["hash_ok"] is False
    assert bb["hash"] == a1b.hash and bb["hash_ok"] is True
    assert a["lag"] == 0 and bb["lag"] == 0  # the version number alone would not show it
    assert state()["flags"]["hash_mismatch"] == ["gen-a"]
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)}
    mismatch = {s.labels["generator"]: s.value for s in families["relay_broker_generator_hash_mismatch"].samples}
    assert mismatch == {"gen-a": 1.0, "gen-b": 0.0}
    res = relay("status", "--url", url, "--check", timeout=30)
    assert res.returncode == 3, res.stdout + res.stderr
    line_a = next(ln for ln in res.stdout.splitlines() if ln.startswith("gen-a"))
    assert f"MISMATCH (announced {a1b.hash[:12]})" in line_a
    assert "MISMATCH" not in next(ln for ln in res.stdout.splitlines() if ln.startswith("gen-b"))

    # nobody consumes the queue (3 groups at most): the generators are paused by back-pressure
    wait_until(
        lambda: any(g["state"] == "paused_backpressure" for g in gens().values()),
        60,
        "a generator paused by back-pressure",
    )
    assert read_stats(r, keys, "broker")["busy"] >= 1
    st = wait_until(lambda: (st := state())["failures"]["reward_failures"] >= 2 and st, 30, "reward failures")
    assert set(st["failures"]["reward_failures_by_plugin"]) == {"reward_service"}
    gen_b_metrics = httpx.get(f"http://127.0.0.1:{gens()['gen-b']['metrics_port']}/metrics", timeout=10).text
    failed = [
        s
        for f in text_string_to_metric_families(gen_b_metrics)
        if f.name == "relay_generator_reward_failures"
        for s in f.samples
    ]
    assert [s.labels["plugin"] for s in failed] == ["reward_service"] and failed[0].value >= 2

    # the page: gen-a's row red, with an alert naming it; gen-b's row normal
    page_checked = _check_page(request, url, a1.hash, a1b.hash)

    # gen-b dies without a word (SIGKILL: no final heartbeat): shown dead after dead_after_s
    os.kill(next(c.pid for c in procs.children if c.name == "gen-b"), signal.SIGKILL)
    wait_until(lambda: gens()["gen-b"]["state"] == "dead", 30, "gen-b shown dead")
    assert state()["flags"]["dead"] == ["gen-b"] and gens()["gen-a"]["state"] != "dead"
    if not page_checked:
        pytest.skip("the API flags were checked; the page was not (no browser, see the reason above)")


def _check_page(request, url: str, served: str, announced: str) -> bool:
    """The browser half of the test; False (after the API checks) when no browser is available."""
    from tests.support.browser import chromium_or_skip

    try:
        chromium_or_skip()
    except pytest.skip.Exception as e:  # keep going with the API checks; the test reports the skip at the end
        print(f"page not checked: {e}")
        return False
    b = request.getfixturevalue("browser")
    page = b.new_page(viewport={"width": 1400, "height": 900})
    page.goto(url + "/")
    row_a = page.locator('#generators tr[data-id="gen-a"]')
    page.wait_for_function(
        "document.querySelector('#generators tr[data-id=\"gen-a\"]')?.dataset.hashOk === 'false'", timeout=30_000
    )
    assert "hash-mismatch" in row_a.get_attribute("class")
    # red: the row's cells are drawn on a red-tinted background with red text
    # (both read in one call, on the cell as rendered now: the table is redrawn on every push, and a
    # cell read while being replaced reports no style)
    style = (
        "() => { const td = document.querySelector('#generators tr[data-id=\"gen-a\"] td');"
        " const cs = td && td.isConnected ? getComputedStyle(td) : null;"
        " return cs ? [cs.backgroundColor, cs.color] : null; }"
    )
    from playwright.sync_api import TimeoutError as PageTimeout

    try:
        page.wait_for_function(
            f"(({style})() || []).join('|') === 'rgb(253, 228, 227)|rgb(208, 49, 45)'", timeout=10_000
        )
    except PageTimeout:
        pass  # the assertion below reports what the page shows
    assert page.evaluate(style) == ["rgb(253, 228, 227)", "rgb(208, 49, 45)"], page.evaluate(style)
    hash_cell = row_a.locator("td.hash").inner_text()
    assert served[:12] in hash_cell and announced[:12] in hash_cell
    row_b = page.locator('#generators tr[data-id="gen-b"]')
    assert row_b.get_attribute("data-hash-ok") == "true" and "hash-mismatch" not in (row_b.get_attribute("class") or "")
    assert "gen-a serves hash" in page.inner_text("#alerts")
    assert "reward_service" in page.inner_text("#failures")  # reward failures by plugin
    page.wait_for_function(
        "document.querySelector('#generators tr [class~=\"st-paused_backpressure\"]') !== null", timeout=30_000
    )
    screenshot(page, "dashboard-stale-hash.png")
    page.close()
    return True
