"""The learner's observability: each step's metrics go into a capped Redis stream (the dashboard's
charts: reward curve, staleness histogram, off-policy diagnostics) and into Prometheus metrics at
``/metrics``, served with ``/healthz`` on ``metrics_host:metrics_port`` (names in docs/dashboard.md).

No torch here: the trainer hands over its per-step diagnostics dict (plain floats and ints).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter

import redis
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from broker.client.telemetry import add_learner_step, register_service
from broker.protocol.keys import Keys
from broker.runtime.metrics import MetricsServer, advertised_host, labelled_registry
from learner.config import LearnerConfig

log = logging.getLogger("relay.learner.observe")

# per-step scalars exported as relay_learner_<key> gauges (the last step's value)
GAUGES = {
    "step": "optimizer steps taken",
    "version": "the learner's latest published weight version",
    "reward_mean": "mean reward of the last step's groups",
    "loss": "policy loss of the last step",
    "entropy": "mean per-token entropy of the sampling distribution, last step",
    "grad_norm": "global gradient norm before clipping (DeepSpeed's), last step",
    "lr": "learning rate of the last optimizer step",
    "ess": "effective sample size (sum w)^2 / (n sum w^2) of the correction weights, last step",
    "frac_clipped": "fraction of tokens whose PPO ratio was clipped, last step",
    "frac_truncated": "fraction of tokens whose importance weight was truncated (tis), last step",
    "frac_masked": "fraction of tokens masked by the correction (mis/IcePop), last step",
    "mismatch_kl": "mean(log mu - log pi_old) over tokens: behaviour vs learner mismatch, last step",
    "mismatch_kl_fresh": "the same over the tokens of samples of staleness 0 (the engines' numerics alone), last step",
    "ratio_mean": "mean importance ratio pi_old/mu, last step",
    "ratio_min": "smallest importance ratio pi_old/mu, last step",
    "ratio_max": "largest importance ratio pi_old/mu, last step",
    "completion_len_mean": "mean completion length in tokens, last step",
    "completion_len_max": "longest completion in tokens, last step",
    "completion_truncated_frac": "fraction of completions stopped at max_tokens (finish_reason length), last step",
    "padding_fraction": "share of the forward passes' token slots that were padding, last step",
    "tokens_outside_kept_set": "trained tokens outside the current policy's top-k/top-p kept set (masked), last step",
    "value_loss": "the critic's clipped value loss, last step (learner.critic)",
    "explained_variance": "1 - Var(returns - values) / Var(returns) of the critic's values, last step",
    "value_clip_frac": "fraction of tokens whose clipped value error was the larger, last step",
    "values_mean": "mean value of the critic over the last step's tokens",
    "metrics_nonfinite": "non-finite values replaced by null in the last step's metrics",
}
# phase -> the metrics line's key: the seconds of each step spent waiting for groups, computing, and
# blocked by publication (the snapshot and any wait for the publisher thread; writing runs behind)
PHASES = {"wait": "wait_s", "compute": "compute_s", "publish": "publish_blocked_s"}
# counters of the learner's refusals of non-finite numbers (the metrics line's running totals)
NONFINITE_COUNTERS = {
    "skipped_steps": "optimizer steps skipped because the loss or the gradient norm was NaN or inf",
    "publish_refused_nonfinite": "publications refused because a weight was NaN or inf",
}
# counters of the publisher's back-pressure (learner/publish.py)
PUBLISH_COUNTERS = {
    "publish_skipped": "versions replaced by a newer one while waiting for the publisher (skip to the newest)",
}


def finite_metrics(diag: dict) -> dict:
    """``diag`` with every NaN or infinite number replaced by None (strict JSON: metrics.jsonl, the
    dashboard's stream), and their count in ``metrics_nonfinite``: reported, never silent."""
    count = 0

    def clean(v):
        nonlocal count
        if isinstance(v, float) and not math.isfinite(v):
            count += 1
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    out = {k: clean(v) for k, v in diag.items()}
    out["metrics_nonfinite"] = count
    return out


class _StepCollector(Collector):
    def __init__(self, obs: LearnerObserver):
        self.obs = obs

    def describe(self):
        return []

    def collect(self):
        last = self.obs.last
        for key, doc in GAUGES.items():
            g = GaugeMetricFamily(f"relay_learner_{key}", doc)
            if isinstance(last.get(key), (int, float)):
                g.add_metric([], last[key])
            yield g
        groups = CounterMetricFamily(
            "relay_learner_groups", "groups consumed, by outcome (trained or why dropped)", labels=["outcome"]
        )
        for k, n in sorted(self.obs.counts.items()):
            groups.add_metric([k], n)
        yield groups
        stale = CounterMetricFamily(
            "relay_learner_samples_trained", "samples trained on, by staleness in versions", labels=["staleness"]
        )
        for k, n in sorted(self.obs.staleness.items()):
            stale.add_metric([str(k)], n)
        yield stale
        tokens = CounterMetricFamily("relay_learner_tokens_trained", "completion tokens trained on")
        tokens.add_metric([], self.obs.tokens)
        yield tokens
        for key, doc in {**NONFINITE_COUNTERS, **PUBLISH_COUNTERS}.items():
            c = CounterMetricFamily(f"relay_learner_{key}", doc)
            c.add_metric([], self.obs.last.get(key) or 0)
            yield c


class LearnerObserver:
    """Started before the model loads (so ``/healthz`` answers during start-up); ``record`` after each step."""

    def __init__(self, r: redis.Redis, keys: Keys, cfg: LearnerConfig):
        self.r, self.keys, self.max_len = r, keys, cfg.metrics.history
        self.last: dict = {}
        self.counts: Counter = Counter()
        self.staleness: Counter = Counter()
        self.tokens = 0
        registry = CollectorRegistry()
        self.phase = Histogram(
            "relay_learner_step_phase_seconds",
            "time per step waiting for groups, computing, blocked by publication",
            ["phase"],
            registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )

        def healthy() -> tuple[bool, str]:
            try:
                r.ping()
            except redis.RedisError as e:
                return False, f"redis unavailable: {e}"
            return True, f"ok step {self.last.get('step', 0)}"

        self.server = MetricsServer(
            cfg.metrics.host,
            cfg.metrics.port,
            labelled_registry("learner", "0", registry, _StepCollector(self)),
            healthy,
        )
        self.r.hset(keys.stats("learner"), "metrics_port", self.server.port)
        register_service(r, keys, "learner", "0", advertised_host(cfg.metrics.host), self.server.port)

    def record(self, diag: dict) -> None:
        """One step's diagnostics: append to the ``learner_metrics`` stream (per-group lists left out)
        and update the Prometheus metrics."""
        entry = {k: v for k, v in diag.items() if not isinstance(v, list)}
        add_learner_step(self.r, self.keys, entry.get("step", 0), json.dumps(entry, allow_nan=False), self.max_len)
        self.last = entry
        for k, v in entry.items():
            if k.startswith("groups_") and isinstance(v, int):
                self.counts[k[len("groups_") :]] = v
        for k, n in (entry.get("staleness") or {}).items():
            self.staleness[int(k)] += int(n)
        self.tokens += int(entry.get("tokens", 0))
        for phase, key in PHASES.items():
            if isinstance(entry.get(key), (int, float)):
                self.phase.labels(phase).observe(entry[key])


def node_health(cfg: LearnerConfig, r) -> MetricsServer | None:
    """``/healthz`` on the metrics address for a node of a learner across nodes whose first rank is not the
    leader (deploy/launcher/nodes.py), so every node's container has the probe the leader's has (compose,
    Kubernetes): healthy while Redis answers. Its ``/metrics`` is empty (the leader's has the run's). None
    for every other rank."""
    import os

    if os.environ.get("RELAY_LEARNER_NODES") != "1" or os.environ.get("LOCAL_RANK") != "0":
        return None

    def healthy() -> tuple[bool, str]:
        try:
            r.ping()
        except redis.RedisError as e:
            return False, f"redis unavailable: {e}"
        return True, "ok (a learner node; the leader's /metrics has the run's metrics)"

    return MetricsServer(cfg.metrics.host, cfg.metrics.port, CollectorRegistry(), healthy)
