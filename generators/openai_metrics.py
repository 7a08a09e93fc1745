"""The OpenAI endpoint's counters and the Prometheus metrics made of them (yielded by the generator's
``/metrics``: generators/metrics.py; names in docs/dashboard.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

from generators.sessions import Sessions


@dataclass
class EndpointCounters:
    """What the endpoint counts as it answers (its sessions count their own)."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (endpoint, outcome) -> count
    groups: dict[str, int] = field(default_factory=lambda: {"sent": 0, "rejected": 0, "failed": 0})
    rewarded: dict[str, int] = field(default_factory=lambda: {"caller": 0, "reward_service": 0})  # by source
    tokens: dict[str, int] = field(default_factory=lambda: {"context": 0, "sampled": 0})
    untracked: int = 0  # calls without a session id: answered, not trained

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)] = self.requests.get((endpoint, outcome), 0) + 1


def endpoint_metrics(c: EndpointCounters, sessions: Sessions):
    """The endpoint's metric families, read at scrape time."""
    req = CounterMetricFamily(
        "relay_generator_openai_requests",
        "requests to the OpenAI-compatible endpoint",
        labels=["endpoint", "outcome"],
    )
    for (ep, outcome), n in sorted(c.requests.items()):
        req.add_metric([ep, outcome], n)
    yield req
    ss = sessions
    sess = CounterMetricFamily(
        "relay_generator_openai_sessions", "endpoint sessions started, and dropped idle", labels=["outcome"]
    )
    sess.add_metric(["started"], ss.started)
    sess.add_metric(["dropped_idle"], ss.dropped_idle)
    yield sess
    yield GaugeMetricFamily("relay_generator_openai_open_sessions", "endpoint sessions held now", value=len(ss.by_id))
    yield CounterMetricFamily(
        "relay_generator_openai_template_drift",
        "endpoint calls whose chat-template rendering did not extend the session's sampled tokens",
        value=ss.template_drift,
    )
    grp = CounterMetricFamily("relay_generator_openai_groups", "endpoint groups by outcome", labels=["outcome"])
    for k, n in {**c.groups, "unusable": ss.groups_unusable}.items():
        grp.add_metric([k], n)
    yield grp
    rew = CounterMetricFamily(
        "relay_generator_openai_rewards",
        "sessions' rewards by where they came from (caller: a number the caller posted; reward_service)",
        labels=["source"],
    )
    for k, n in c.rewarded.items():
        rew.add_metric([k], n)
    yield rew
    tok = CounterMetricFamily("relay_generator_openai_tokens", "endpoint tokens recorded, by kind", labels=["kind"])
    for k, n in c.tokens.items():
        tok.add_metric([k], n)
    yield tok
