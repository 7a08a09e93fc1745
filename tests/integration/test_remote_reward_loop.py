"""The loop trains on the scores of a separate reward server written from docs/rewards.md
(tests/support/remote_reward_server.py, stdlib only), registered as a remote plugin; when that server
answers 500, hangs or returns garbage, items fail with the right reason and the run goes on. 500s and
hangs are outages: the generator holds its batch and pauses (paused_reward; for 30 s nothing is sent,
claimed beyond the held batches, or dropped) and sends it scored once the server is back; garbage is the
plugin's own failure: counted by the reward service's /metrics and the generators' heartbeats, dropped."""

import json
import subprocess
import sys
import time

import httpx
import pytest

from broker.client.connection import connect_redis
from broker.client.telemetry import read_heartbeats
from broker.protocol.keys import Keys
from deploy.launcher.procs import free_port
from deploy.launcher.run_secrets import run_redis_url
from tests.support.services import ROOT, child_env, metric_value, wait_http, wait_until

STEPS, GROUPS, N = 20, 4, 4


@pytest.mark.slow
def test_loop_trains_on_a_remote_reward_server_and_survives_its_failures(procs, tmp_path):
    port = free_port()
    env = dict(child_env(), REMOTE_TOKEN="s3cret-token")
    server = procs.start(
        "remote",
        [
            sys.executable,
            str(ROOT / "tests" / "support" / "remote_reward_server.py"),
            "--port",
            str(port),
            "--token-env",
            "REMOTE_TOKEN",
        ],
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/stats", server)
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
[reward]
task_plugins = {{ copy = "scorer" }}
auth_token = "loop-token"  # relay up hands it to the generators

[reward.plugins.scorer]
type = "remote"

[reward.plugins.scorer.options]
url = "{base}/score"
token_env = "REMOTE_TOKEN"
timeout_s = 1.0
retries = 1
backoff_s = 0.05
breaker_failures = 3
breaker_reset_s = 0.5

[learner]
batch_groups = {GROUPS}

[generator]
prompts_per_batch = {GROUPS}
sampling = {{ n = {N} }}
""")
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "up",
            "--steps",
            str(STEPS),
            "--generators",
            "1",
            "--config",
            str(cfg),
            "--runs-dir",
            str(tmp_path),
            "--run-id",
            "remote",
            "--dashboard-port",
            "0",
            "--no-progress",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = tmp_path / "remote"
    try:
        deadline = time.monotonic() + 240
        while not (run / "config" / "reward.json").is_file() or not (run / "learner" / "metrics.jsonl").is_file():
            assert up.poll() is None and time.monotonic() < deadline, up.stdout.read() if up.poll() is not None else ""
            time.sleep(0.5)
        reward = f"http://127.0.0.1:{json.loads((run / 'config' / 'reward.json').read_text())['port']}"
        r = connect_redis(run_redis_url(run))
        keys = Keys("remote")

        def heartbeat_failures() -> int:
            return sum(hb.reward_failures for hb in read_heartbeats(r, keys).values())

        def heartbeat() -> dict:
            hbs = list(read_heartbeats(r, keys).values())
            return {
                "state": hbs[0].state if hbs else "",
                "pauses": sum(h.reward_pauses for h in hbs),
                "sent": sum(h.groups_sent for h in hbs),
                "failures": sum(h.reward_failures for h in hbs),
            }

        def dropped() -> int:
            lines = (run / "learner" / "metrics.jsonl").read_text().splitlines()
            return json.loads(lines[-1])["groups_dropped_reward_failed"] if lines else 0

        seen = {}
        # 500s and hangs are outages: the generator holds its batch and pauses (no prompt burnt, nothing
        # dropped); the 500 phase lasts 30 s. Garbage is the plugin's fault, not an outage: failed, dropped.
        for mode, reason, outage_s in (
            ("500", "remote_http_500", 30.0),
            ("hang", "remote_timeout", 0.0),
            ("garbage", "remote_malformed", None),
        ):
            before = metric_value(
                httpx.get(f"{reward}/metrics").text,
                "relay_reward_items_total",
                plugin="scorer",
                status="failed",
                reason=reason,
            )
            hb_before = heartbeat()
            httpx.post(f"{base}/control", json={"mode": mode})
            t_end = time.monotonic() + 90
            while True:
                assert up.poll() is None, f"the run stopped during the {mode} phase:\n{up.stdout.read()}"
                text = httpx.get(f"{reward}/metrics").text
                now = metric_value(text, "relay_reward_items_total", plugin="scorer", status="failed", reason=reason)
                hb = heartbeat()
                if now > before and (
                    hb["failures"] > hb_before["failures"]
                    if outage_s is None
                    else hb["state"] == "paused_reward" and hb["pauses"] > hb_before["pauses"]
                ):
                    break
                assert time.monotonic() < t_end, f"no {reason} failure counted in the {mode} phase:\n{text} {hb}"
                time.sleep(0.3)
            if outage_s:  # the plugin keeps failing: the generator stays paused, sends and drops nothing
                held, dropped_before, paused_at = hb, dropped(), time.monotonic()
                time.sleep(outage_s)
                hb = heartbeat()
                assert hb["state"] == "paused_reward" and hb["sent"] == held["sent"], (held, hb)
                assert hb["failures"] == held["failures"] == hb_before["failures"] and dropped() == dropped_before
                now = metric_value(
                    httpx.get(f"{reward}/metrics").text,
                    "relay_reward_items_total",
                    plugin="scorer",
                    status="failed",
                    reason=reason,
                )
                assert now > before and time.monotonic() - paused_at >= outage_s
            seen[mode] = now - before
            httpx.post(f"{base}/control", json={"mode": "ok"})
            if outage_s is not None:  # the held batch goes out scored: the generator sends again
                wait_until(
                    lambda: heartbeat()["sent"] > hb_before["sent"] and heartbeat()["state"] != "paused_reward",
                    120,
                    f"the generator to resume after the {mode} outage",
                )
        # the reward service counts a batch's failures at once, the generator as it sends its groups (and
        # heartbeats once a second): let it catch up with the garbage phase's last batch
        wait_until(
            lambda: heartbeat_failures() >= seen["garbage"],
            60,
            f"the generator to count the garbage phase's {seen['garbage']} failures",
        )
        hb_failures = heartbeat_failures()
        final_metrics = ""
        while up.poll() is None:  # the last scrape before the run ends (the service stops with it)
            try:
                final_metrics = httpx.get(f"{reward}/metrics", timeout=2).text
            except httpx.HTTPError:
                break
            time.sleep(0.5)
        out, _ = up.communicate(timeout=400)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["groups_trained"] == STEPS * GROUPS, summary
    lines = [json.loads(x) for x in (run / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == STEPS and all(0.0 <= g <= 1.0 for m in lines for g in m["group_rewards"])
    # every trained sample was scored by the remote server and by nothing else
    stats = httpx.get(f"{base}/stats").json()
    assert stats["items_scored"] >= STEPS * GROUPS * N, stats
    assert stats["unauthorized"] == 0  # the bearer token from token_env reached it
    assert (
        0
        < metric_value(final_metrics, "relay_reward_items_total", plugin="scorer", status="ok")
        <= stats["items_scored"]
    )
    assert metric_value(final_metrics, "relay_reward_items_total", plugin="digits") == 0
    # failures were failures: counted by plugin and reason, by the generators, and dropped by the learner
    assert all(v > 0 for v in seen.values()), seen
    assert hb_failures >= seen["garbage"]  # the outages' failures were held and scored again, never sent
    assert metric_value(final_metrics, "relay_reward_remote_requests_total", plugin="scorer", outcome="http_500") > 0
    assert metric_value(final_metrics, "relay_reward_remote_requests_total", plugin="scorer", outcome="timeout") > 0
    assert lines[-1]["groups_dropped_reward_failed"] > 0  # skip mode: all-failed groups dropped and counted
    # and summary.json says so: failures by plugin, the groups dropped for them, no fallback score trained on
    rf = summary["reward_failures"]
    assert rf["samples"] >= seen["garbage"] and rf["by_plugin"].get("scorer", 0) > 0, rf
    assert rf["groups_dropped"] == lines[-1]["groups_dropped_reward_failed"] and rf["fallback_used"] is False, rf
