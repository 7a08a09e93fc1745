"""Dashboard pieces that need no running service: state derivation, metric labels, the status table,
the page's assets (offline), and the Prometheus/Grafana files in deploy/."""

import json
import re

import yaml
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from broker.runtime.metrics import render
from broker.dashboard.state import shown_state
from broker.protocol.messages import Heartbeat
from deploy.status import format_state
from tests.support.services import ROOT

DOCS = (ROOT / "docs" / "dashboard.md").read_text()
STATIC = ROOT / "broker" / "dashboard" / "static"


def test_a_generator_is_dead_only_when_its_heartbeat_is_old_and_it_did_not_stop():
    assert shown_state(Heartbeat(state="sampling", last_seen=100.0), now=105.0, dead_after_s=10) == "sampling"
    assert shown_state(Heartbeat(state="sampling", last_seen=100.0), now=111.0, dead_after_s=10) == "dead"
    assert shown_state(Heartbeat(state="stopped", last_seen=100.0), now=1000.0, dead_after_s=10) == "stopped"
    assert shown_state(Heartbeat(state="paused_backpressure"), now=1.0, dead_after_s=10) == "dead"  # no last_seen


def test_every_sample_gets_service_and_replica_labels_and_no_created_series():
    reg = CollectorRegistry()
    c = Counter("relay_x_things", "things", ["kind"], registry=reg)
    c.labels("a").inc(3)
    h = Histogram("relay_x_seconds", "time", registry=reg, buckets=(1, 2))
    h.observe(1.5)
    text = render("generator", "gen-7", reg).decode()
    assert "_created" not in text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(fams) == {"relay_service_info", "relay_x_things", "relay_x_seconds"}
    for f in fams.values():
        for s in f.samples:
            assert s.labels["service"] == "generator" and s.labels["replica"] == "gen-7"
    assert [s.value for s in fams["relay_x_things"].samples if s.name == "relay_x_things_total"] == [3.0]
    assert fams["relay_x_things"].samples[0].labels["kind"] == "a"


def _state(**gen) -> dict:
    g = {
        "id": "gen-0",
        "backend": "torch",
        "state": "sampling",
        "version": 5,
        "lag": 1,
        "hash": "a" * 64,
        "hash_ok": True,
        "announced_hash": "a" * 64,
        "last_update_latency_s": 0.0123,
        "tokens_per_s": 100.0,
        "age_s": 0.4,
        "groups_sent": 7,
        "refused_updates": 0,
        **gen,
    }
    return {
        "run_id": "r",
        "learner_version": 6,
        "learner_hash": "f" * 64,
        "learner": {"step": 6.0, "reward_mean": 0.5},
        "generators": [g],
        "queue_depth": 3,
        "pending_groups": 1,
        "prompts_ready": 9,
        "rates": {"groups_in_per_s": 2.0, "groups_out_per_s": 1.5},
        "failures": {
            "rejected": {"bad_logprob": 2},
            "learner_dropped": {},
            "reward_failures_by_plugin": {},
            "refused_updates": 0,
        },
    }


def test_status_table_shows_versions_lag_and_flags_a_wrong_hash():
    ok = format_state(_state()).splitlines()
    assert ok[0].startswith("run r   learner version 6 (ffffffffffff)   step 6   reward 0.500")
    assert "failures: rejected: bad_logprob=2" in ok[2]
    header, row = ok[4], ok[5]
    assert header.split()[:6] == ["GENERATOR", "BACKEND", "STATE", "VERSION", "LAG", "HASH"]
    assert row.split()[:8] == ["gen-0", "torch", "sampling", "5", "1", "a" * 12, "ok", "12"]
    bad = format_state(_state(hash_ok=False, announced_hash="b" * 64)).splitlines()[5]
    assert "MISMATCH (announced bbbbbbbbbbbb)" in bad


def test_the_page_needs_nothing_but_the_broker():
    html = (STATIC / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert "/static/dashboard.js" in refs and "/static/dashboard.css" in refs
    for ref in refs:
        assert not ref.startswith(("http:", "https:", "//")), ref  # no CDN
        if ref.startswith("/static/"):
            assert (STATIC / ref[len("/static/") :]).is_file(), ref
    for f in STATIC.iterdir():
        text = f.read_text()
        assert not re.search(r"""(?:src=|href=|url\(|import\s|fetch\()\s*["']?(?:https?:)?//""", text), f
    # the package ships them
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'broker = ["dashboard/static/*"]' in pyproject


def test_grafana_dashboard_and_scrape_config_use_documented_metrics():
    dash = json.loads((ROOT / "deploy" / "grafana" / "relay.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 20
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"\brelay_[a-z_]+", e)}
    undocumented = {n for n in used if f"`{n}`" not in DOCS}
    assert not undocumented, undocumented
    for needed in (
        "relay_broker_generator_hash_mismatch",
        "relay_broker_generator_lag_versions",
        "relay_generator_version",
        "relay_learner_ess",
        "relay_learner_samples_trained_total",
    ):
        assert needed in used
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["relay-broker"]["static_configs"][0]["targets"] == ["127.0.0.1:8080"]
    assert jobs["relay-reward"]["static_configs"][0]["targets"] == ["127.0.0.1:8090"]
    assert jobs["relay-services"]["http_sd_configs"][0]["url"].endswith("/api/prometheus/targets")
    assert "/api/prometheus/targets" in DOCS


def test_episode_totals_merge_every_generators_episodes_and_stay_empty_for_single_turn_runs():
    from broker.dashboard.state import episode_totals

    assert episode_totals([{}, {}]) == {}  # single-turn generators report no episodes: the panel stays hidden
    e = episode_totals(
        [
            {
                "episodes": 10,
                "turns": 25,
                "env_seconds": 1.0,
                "template_drift": 0,
                "tool_calls": {"calculator": 12},
                "tool_failures": {"calculator": 2},
                "env_failures": {},
            },
            {
                "episodes": 30,
                "turns": 55,
                "env_seconds": 3.0,
                "template_drift": 1,
                "tool_calls": {"calculator": 28, "python": 3},
                "tool_failures": {},
                "env_failures": {"timeout": 4},
            },
            {},
        ]
    )
    assert e["episodes"] == 40 and e["turns_per_episode"] == 2.0 and e["env_seconds_per_episode"] == 0.1
    assert e["tool_calls"] == {"calculator": 40, "python": 3} and e["tool_failures"] == {"calculator": 2}
    assert e["env_failures"] == {"timeout": 4} and e["template_drift"] == 1


def test_reward_pauses_are_in_api_state_per_generator_and_summed(redis_url):
    """docs/rewards.md: the heartbeats' reward_pauses are in /api/state, per generator and in failures."""
    import time

    import redis

    from broker.dashboard.state import build_state
    from broker.protocol.keys import Keys

    r, k = redis.Redis.from_url(redis_url), Keys("r")
    for gid, pauses in (("gen-0", 2), ("gen-1", 3)):
        r.hset(
            k.generators,
            gid,
            json.dumps({"id": gid, "last_seen": time.time(), "reward_pauses": pauses, "reward_paused_s": 1.5}),
        )
    st = build_state(r, k)
    assert sorted(g["reward_pauses"] for g in st["generators"]) == [2, 3]
    assert st["failures"]["reward_pauses"] == 5
