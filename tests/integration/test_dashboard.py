"""The dashboard and observability of a running tiny loop (`relay up`, every service its own process):
a real headless Chromium watches it live, every service's /metrics parses, `relay status` prints it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.launcher.run_secrets import run_redis_url
from tests.support.services import ROOT, child_env, relay
from tests.support.browser import browser, screenshot  # noqa: F401  (browser is a fixture)

pytestmark = pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)

DOCS = (ROOT / "docs" / "dashboard.md").read_text()


@dataclass
class Loop:
    proc: subprocess.Popen
    run_dir: Path
    url: str = ""
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self.lines)

    def state(self) -> dict:
        return httpx.get(self.url + "api/state", timeout=10).json()


def _wait(fn, timeout: float, what: str, loop: Loop | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if loop is not None and loop.proc.poll() is not None:
            raise AssertionError(f"relay up exited ({loop.proc.returncode}) while waiting for {what}:\n{loop.output()}")
        try:
            v = fn()
        except httpx.HTTPError:
            v = None
        if v:
            return v
        time.sleep(0.25)
    raise TimeoutError(f"{what} within {timeout}s" + (f"\n{loop.output()[-3000:]}" if loop else ""))


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """`relay up` at tiny size with a step budget it will not reach: the tests watch it train, then
    Ctrl-C stops it (and the fixture checks that every process went away cleanly)."""
    runs = tmp_path_factory.mktemp("runs")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "up",
            "--steps",
            "5000",
            "--dashboard-port",
            "0",
            "--runs-dir",
            str(runs),
            "--run-id",
            "dash",
            "--no-progress",
            "--set",
            "learner.batch.groups=4",
            "--set",
            "generator.prompts_per_batch=2",
            "--set",
            "generator.sampling.n=4",
        ],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lp = Loop(proc, runs / "dash")
    threading.Thread(target=lambda: [lp.lines.append(x) for x in proc.stdout], daemon=True).start()
    try:
        m = _wait(
            lambda: re.search(r"dashboard at (http://127\.0\.0\.1:\d+/)", lp.output()), 60, "the dashboard URL", lp
        )
        lp.url = m.group(1)
        _wait(
            lambda: (
                (st := lp.state())
                and len([g for g in st["generators"] if g["version"] is not None]) >= 2
                and st["learner"].get("step", 0) >= 2
            ),
            240,
            "two generators serving and two learner steps",
            lp,
        )
        yield lp
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
    assert proc.returncode == 130, lp.output()[-3000:]


def test_browser_lists_generators_and_shows_the_version_rising_live(loop, browser):  # noqa: F811
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    navigations, requests, errors = [], [], []
    page.on("framenavigated", lambda f: navigations.append(f.url) if f == page.main_frame else None)
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(loop.url)
    page.wait_for_function("document.querySelectorAll('#generators tbody tr[data-id]').length >= 2", timeout=30_000)
    ids = page.eval_on_selector_all("#generators tbody tr[data-id]", "rows => rows.map(r => r.dataset.id)")
    assert sorted(ids) == ["gen-0", "gen-1"]
    page.evaluate("window.__sameDocument = true")  # survives only if the page is never reloaded
    page.wait_for_function("/^\\d+$/.test(document.getElementById('learner-version').textContent)")
    v1 = int(page.inner_text("#learner-version"))
    updates1 = int(page.evaluate("document.body.dataset.updates || 0"))
    page.wait_for_function(
        f"Number(document.getElementById('learner-version').textContent) >= {v1 + 3}", timeout=120_000
    )
    v2 = int(page.inner_text("#learner-version"))
    assert v2 >= v1 + 3
    assert page.evaluate("window.__sameDocument") is True and len(navigations) == 1, navigations
    assert int(page.evaluate("document.body.dataset.updates")) > updates1  # it came over the event stream
    assert page.inner_text("#conn") == "live"
    # each generator's row shows the version it serves and a lag computed against the learner
    for gid in ("gen-0", "gen-1"):
        row = page.locator(f'#generators tr[data-id="{gid}"]')
        assert int(row.locator("td.version").inner_text()) <= v2
        assert row.get_attribute("data-hash-ok") == "true"
    # the charts and the timeline drew from the histories
    page.wait_for_function("document.querySelectorAll('#chart-reward path').length >= 2")
    assert page.locator("#timeline circle").count() >= 3  # published versions
    assert page.locator("#timeline rect").count() >= 2  # applied by the generators
    assert page.locator("#chart-staleness rect").count() >= 1
    # the critic's panel only shows when the learner trains one (learner.critic.enabled; not in this run)
    assert page.evaluate("getComputedStyle(document.getElementById('panel-critic')).display") == "none"
    # so does the Episodes panel, for a multi-turn task only (this run is single-turn); fed the state of one
    # (broker/dashboard/state.py episode_totals), it shows the turns, the tools and a template drift in red
    assert page.evaluate("getComputedStyle(document.getElementById('panel-episodes')).display") == "none"
    # (in one turn of the page's event loop, so that a live update cannot re-render it in between)
    shown = page.evaluate("""() => {
        renderEpisodes({episodes: {episodes: 40, turns: 100, turns_per_episode: 2.5, env_seconds: 4,
          env_seconds_per_episode: 0.1, template_drift: 1, tool_calls: {calculator: 43},
          tool_failures: {calculator: 2}, env_failures: {timeout: 4}}});
        const out = [getComputedStyle(document.getElementById('panel-episodes')).display,
                     document.getElementById('episodes-turns').textContent, document.getElementById('episodes').innerText,
                     document.getElementById('template-drift').textContent];
        renderEpisodes({episodes: {}});
        return out;
    }""")
    assert shown[0] != "none" and shown[1] == "2.50" and "calculator" in shown[2] and "timeout" in shown[2], shown
    assert "template drift: 1" in shown[3], shown
    shot = screenshot(page, "dashboard.png")
    assert shot.stat().st_size > 20_000
    # everything came from the broker itself: no CDN, works offline
    assert requests and all(u.startswith(loop.url) or u.startswith("data:") for u in requests), requests
    assert not errors, errors
    page.close()


def _metric_names(text: str) -> tuple[set[str], list]:
    families = list(text_string_to_metric_families(text))
    names = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    return names, families


def test_every_service_serves_parseable_labelled_and_documented_metrics(loop):
    st = loop.state()
    # relay up prints where the reward service listens (its /metrics, /healthz), as it does the dashboard
    reward_url = re.search(r"reward service at (http://127\.0\.0\.1:\d+) ", loop.output()).group(1)
    reward_port = json.loads((loop.run_dir / "config" / "reward.json").read_text())["port"]
    assert reward_url == f"http://127.0.0.1:{reward_port}"
    endpoints = {
        ("broker", "0"): loop.url.rstrip("/"),
        ("reward", "0"): reward_url,
        ("learner", "0"): f"http://127.0.0.1:{int(st['learner']['metrics_port'])}",
    }
    for g in st["generators"]:
        endpoints[("generator", g["id"])] = f"http://127.0.0.1:{g['metrics_port']}"
    assert len(endpoints) == 5
    expected = {
        "broker": {
            "relay_broker_groups_total",
            "relay_broker_learner_version",
            "relay_broker_queue_groups",
            "relay_broker_generator_lag_versions",
            "relay_broker_generator_hash_mismatch",
        },
        "reward": {"relay_reward_items_total"},
        "learner": {
            "relay_learner_step",
            "relay_learner_version",
            "relay_learner_ess",
            "relay_learner_samples_trained_total",
            "relay_learner_step_phase_seconds",
        },
        "generator": {
            "relay_generator_version",
            "relay_generator_tokens_total",
            "relay_generator_last_update_latency_seconds",
            "relay_generator_state",
        },
    }
    undocumented = set()
    for (service, replica), base in endpoints.items():
        assert httpx.get(base + "/healthz", timeout=10).status_code == 200, base
        text = httpx.get(base + "/metrics", timeout=10).text
        names, families = _metric_names(text)
        assert expected[service] <= names, (service, expected[service] - names)
        for f in families:
            assert f.name.startswith("relay_"), f.name
            for s in f.samples:
                assert s.labels.get("service") == service and s.labels.get("replica") == replica, (service, s)
        undocumented |= {n for n in names if f"`{n}`" not in DOCS}
    assert not undocumented, f"metrics missing from docs/dashboard.md: {sorted(undocumented)}"
    # Prometheus HTTP service discovery from the broker finds the learner and both generators
    targets = httpx.get(loop.url + "api/prometheus/targets", timeout=10).json()
    found = {(t["labels"]["service"], t["labels"]["replica"]) for t in targets}
    assert {("broker", "0"), ("learner", "0"), ("generator", "gen-0"), ("generator", "gen-1")} <= found
    for t in targets:
        assert httpx.get(f"http://{t['targets'][0]}/metrics", timeout=10).status_code == 200


def test_history_endpoints_and_event_stream(loop):
    learner = httpx.get(loop.url + "api/history/learner", timeout=10).json()["entries"]
    assert len(learner) >= 2
    steps = [e["step"] for e in learner]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    last = learner[-1]
    for key in ("reward_mean", "ess", "frac_clipped", "mismatch_kl", "staleness", "version", "loss"):
        assert key in last, key
    assert "group_rewards" not in last  # big per-group lists stay out of the stream
    assert sum(last["staleness"].values()) == last["samples"]
    events = httpx.get(loop.url + "api/history/events", timeout=10).json()["entries"]
    kinds = {e["kind"] for e in events}
    assert {"published", "applied"} <= kinds
    assert any(e["kind"] == "applied" and e["generator"] == "gen-1" for e in events)
    newer = httpx.get(loop.url + f"api/history/learner?after={learner[-1]['id']}", timeout=10).json()["entries"]
    assert all(e["step"] > last["step"] for e in newer)
    thr = _wait(lambda: httpx.get(loop.url + "api/history/throughput", timeout=10).json()["samples"], 10, "samples")
    assert {"t", "queue_depth", "pending", "in_per_s", "out_per_s"} <= set(thr[-1])

    # the SSE stream: a state at once, then new learner steps as they happen
    got: dict[str, list] = {}
    q = f"learner_after={learner[-1]['id']}&events_after={events[-1]['id']}"
    deadline = time.monotonic() + 60
    with httpx.stream("GET", loop.url + "api/stream?" + q, timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: ") and kind:
                got.setdefault(kind, []).append(json.loads(line[len("data: ") :]))
            if ("learner" in got and "events" in got and len(got.get("state", [])) >= 2) or time.monotonic() > deadline:
                break
    assert got["state"][0]["run_id"] == "dash" and len(got["state"][0]["generators"]) == 2
    assert got["learner"][0][0]["step"] > last["step"]
    assert all(_sid(e["id"]) > _sid(events[-1]["id"]) for e in got["events"][0])  # only what came after the cursor


def _sid(stream_id: str) -> tuple[int, int]:
    ms, seq = stream_id.split("-")
    return int(ms), int(seq)


def test_relay_status_prints_the_state_as_a_table(loop):
    res = relay("status", "--url", loop.url, timeout=30)
    assert res.returncode == 0, res.stderr
    head = res.stdout.splitlines()
    m = re.match(r"run dash\s+learner version (\d+) \(([0-9a-f]{12})\)", head[0])
    assert m, res.stdout
    table = head[head.index("") + 1 :]
    assert table[0].split()[:5] == ["GENERATOR", "BACKEND", "STATE", "VERSION", "LAG"]
    rows = {ln.split()[0]: ln.split() for ln in table[1:]}
    assert set(rows) == {"gen-0", "gen-1"}
    for r in rows.values():
        assert r[1] == "torch" and int(r[3]) <= int(m.group(1)) + 1 and r[6] == "ok"

    redis_url = run_redis_url(loop.run_dir)  # the launcher's Redis user: it may read the run's keys
    res = relay("status", "--redis-url", redis_url, "--run-id", "dash", "--json", "--check", timeout=30)
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert [g["id"] for g in st["generators"]] == ["gen-0", "gen-1"] and st["learner_version"] >= int(m.group(1))
    res = relay("status", "--redis-url", redis_url, timeout=30)
    assert res.returncode == 1 and "--run-id is required" in res.stderr and "dash" in res.stderr
