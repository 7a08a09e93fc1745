"""A generator's Prometheus metrics, read from the running generator at scrape time, and its
``/metrics`` + ``/healthz`` server (names documented in docs/dashboard.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from broker.client.telemetry import register_service
from broker.runtime.metrics import MetricsServer, advertised_host, labelled_registry

if TYPE_CHECKING:
    from generators.service import Generator

STATES = (
    "starting",
    "waiting_for_weights",
    "updating",
    "sampling",
    "waiting_for_prompts",
    "sending",
    "paused_staleness",
    "paused_backpressure",
    "paused_reward",
    "draining",
    "stopped",
)


class GeneratorCollector(Collector):
    def __init__(self, gen: Generator):
        self.gen = gen

    def describe(self):
        return []

    def collect(self):
        g, w, sink = self.gen, self.gen.weights, self.gen.sink
        v = GaugeMetricFamily("relay_generator_version", "weight version served (absent before the first load)")
        if w.version is not None:
            v.add_metric([], w.version)
        yield v
        state = GaugeMetricFamily("relay_generator_state", "1 for the state the generator is in", labels=["state"])
        for s in sorted(set(STATES) | {g.state}):
            state.add_metric([s], 1 if s == g.state else 0)
        yield state
        tps = GaugeMetricFamily("relay_generator_tokens_per_second", "completion tokens per second of the last batch")
        tps.add_metric([], g.tokens_per_s)  # what the heartbeat reports as tokens_per_s
        yield tps
        tok = CounterMetricFamily("relay_generator_tokens", "completion tokens sampled")
        tok.add_metric([], g.tokens)
        yield tok
        groups = CounterMetricFamily(
            "relay_generator_groups", "groups sent, by the broker's answer", labels=["outcome"]
        )
        groups.add_metric(["sent"], sink.groups_sent)
        groups.add_metric(["rejected"], sink.groups_rejected)
        yield groups
        upd = CounterMetricFamily("relay_generator_updates", "weight versions applied or refused", labels=["outcome"])
        upd.add_metric(["applied"], w.updates)
        upd.add_metric(["refused"], w.refused_updates)
        yield upd
        yield CounterMetricFamily(
            "relay_generator_forged_announcements",
            "announcements ignored: their signature "
            "is missing or wrong (written into Redis by someone without the run's key)",
            value=w.forged_announcements,
        )
        lat = GaugeMetricFamily(
            "relay_generator_last_update_latency_seconds", "publish -> apply latency of the last weight update"
        )
        if w.last_update_latency_s is not None:
            lat.add_metric([], w.last_update_latency_s)
        yield lat
        rf = CounterMetricFamily(
            "relay_generator_reward_failures", "samples whose reward failed, by plugin", labels=["plugin"]
        )
        for plugin, n in sorted(sink.scored.failures_by_plugin.items()):
            rf.add_metric([plugin], n)
        yield rf
        busy = CounterMetricFamily("relay_generator_busy_waits", "times the broker answered busy (back-pressure)")
        busy.add_metric([], sink.sender.busy_waits)
        yield busy
        resends = CounterMetricFamily("relay_generator_resends", "groups resent after an ack timeout")
        resends.add_metric([], sink.sender.resends)
        yield resends
        yield GaugeMetricFamily(
            "relay_generator_prompts_held",
            "prompts claimed and not yet released (renewed every claim_idle_s / 3)",
            value=g.leases.held(),
        )
        yield CounterMetricFamily(
            "relay_generator_prompts_taken_over",
            "held prompts another generator took over while this one was stopped or hung",
            value=g.leases.lost,
        )
        if g.cfg.episodes.env:
            yield from episode_metrics(g.episode_stats.snapshot())
        if getattr(g, "openai", None) is not None:  # the OpenAI-compatible endpoint, when enabled
            yield from g.openai.collect()


def episode_metrics(st: dict):
    """The multi-turn episodes' metrics (generators/episodes.py EpisodeStats.snapshot)."""
    yield CounterMetricFamily("relay_generator_episodes", "multi-turn episodes finished", value=st["episodes"])
    yield GaugeMetricFamily(
        "relay_generator_turns_per_episode", "mean model turns per finished episode", value=st["turns_mean"]
    )
    calls = CounterMetricFamily("relay_generator_tool_calls", "tool calls made in episodes, by tool", labels=["tool"])
    for tool, n in sorted(st["tool_calls"].items()):
        calls.add_metric([tool], n)
    yield calls
    fails = CounterMetricFamily("relay_generator_tool_failures", "tool calls that failed, by tool", labels=["tool"])
    for tool, n in sorted(st["tool_failures"].items()):
        fails.add_metric([tool], n)
    yield fails
    envf = CounterMetricFamily(
        "relay_generator_env_failures",
        "episodes ended by an environment failure (their reward is failed), by reason",
        labels=["reason"],
    )
    for reason, n in sorted(st["env_failures"].items()):
        envf.add_metric([reason], n)
    yield envf
    yield GaugeMetricFamily(
        "relay_generator_env_latency_seconds",
        "mean latency of an environment call (reset or step)",
        value=st["env_latency_s"],
    )
    yield CounterMetricFamily(
        "relay_generator_episodes_truncated",
        "episodes ended by a budget (max_turns, max_episode_tokens)",
        value=st["truncated"],
    )
    yield CounterMetricFamily(
        "relay_generator_template_drift",
        "episodes whose tokens differ from the chat template's rendering of their conversation",
        value=st["template_drift"],
    )
    yield CounterMetricFamily(
        "relay_generator_env_replies_unspellable",
        "environment replies whose text the model's tokenizer cannot spell (the model reads other text)",
        value=st.get("unspellable_replies", 0),
    )


def serve_metrics(gen: Generator) -> MetricsServer:
    """Start the generator's /metrics and /healthz server and register where it is."""
    cfg = gen.cfg

    def healthy() -> tuple[bool, str]:
        try:
            gen.r.ping()
        except redis.RedisError as e:
            return False, f"redis unavailable: {e}"
        return True, f"ok {gen.state}"

    server = MetricsServer(
        cfg.metrics.host, cfg.metrics.port, labelled_registry("generator", cfg.id, GeneratorCollector(gen)), healthy
    )
    register_service(gen.r, gen.keys, "generator", cfg.id, advertised_host(cfg.metrics.host), server.port)
    return server
