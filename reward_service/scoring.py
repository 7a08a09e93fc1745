"""Scoring a batch: route each item to its plugin(s), call each plugin once with all its items,
check what comes back, combine weighted routes, cache, and count everything per plugin.

Independent of HTTP: the FastAPI app and the benchmark's in-process path both call
:meth:`Scorer.score`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from broker.protocol.group import REWARD_LIMIT
from broker.protocol.messages import ResultOut
from reward_service import plugins as P
from reward_service.config import PluginConfig, RewardConfig

log = logging.getLogger("relay.reward")

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def reason_code(reason: str) -> str:
    return reason.split(":", 1)[0].strip()[:48] or "unspecified"


def content_key(plugin: str, it: P.Item) -> bytes:
    return hashlib.sha256(
        json.dumps(
            [plugin, it.prompt, it.completion, it.reference, it.finished, it.task, it.metadata, it.num_tokens],
            sort_keys=True,
            default=str,
        ).encode()
    ).digest()


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.items = Counter(
            "relay_reward_items",
            "items scored, by plugin, status and failure reason",
            ["plugin", "status", "reason"],
            registry=r,
        )
        self.latency = Histogram(
            "relay_reward_batch_seconds",
            "time to score one batch, per plugin",
            ["plugin"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "relay_reward_remote_requests",
            "outbound requests of remote/judge plugins, by outcome",
            ["plugin", "outcome"],
            registry=r,
        )
        self.circuit = Gauge(
            "relay_reward_circuit_open",
            "1 while the plugin's circuit breaker is open or half-open",
            ["plugin"],
            registry=r,
        )
        self.cache = Counter("relay_reward_cache", "content-hash cache lookups", ["plugin", "result"], registry=r)
        self.abandoned = Counter(
            "relay_reward_abandoned_requests",
            "requests whose client went away before the reply: their scoring was cancelled",
            registry=r,
        )


class _Observer(P.Observer):
    def __init__(self, m: Metrics, name: str):
        self.m, self.name = m, name

    def request(self, outcome: str) -> None:
        self.m.requests.labels(self.name, outcome).inc()

    def circuit(self, state: str) -> None:
        self.m.circuit.labels(self.name).set(0.0 if state == "closed" else 1.0)


class Scorer:
    def __init__(self, cfg: RewardConfig, metrics: Metrics | None = None):
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.known = P.known_plugins()
        self.instances: dict[str, P.RewardPlugin] = {}
        self.init_errors: dict[str, str] = {}
        self.cacheable: dict[str, bool] = {}
        self.cache: OrderedDict[bytes, P.Result] = OrderedDict()
        for name, pc in cfg.plugins.items():
            self._build(name, pc)
        for route in cfg.task_plugins.values():
            for name in [route] if isinstance(route, str) else route:
                if name not in self.instances:
                    self._build(name, PluginConfig(type=name))

    def _build(self, name: str, pc: PluginConfig) -> P.RewardPlugin:
        cls = self.known[pc.type]
        inst = cls(cls.Options.model_validate(pc.options), _Observer(self.metrics, name))
        self.instances[name] = inst
        self.cacheable[name] = pc.cache
        return inst

    async def start(self) -> None:
        """Start every configured plugin (fail fast: an error here stops the service)."""
        for name, inst in self.instances.items():
            try:
                await inst.start()
            except Exception as e:
                raise RuntimeError(f"reward plugin {name!r} ({inst.name}) failed to start: {e}") from e

    async def close(self) -> None:
        for inst in self.instances.values():
            await inst.close()

    def route(self, it: P.Item) -> tuple[str, dict[str, float] | None]:
        """(label, weights): weights is None for a single plugin (then label is its name)."""
        key = it.task
        if self.cfg.route_field:
            v = it.metadata.get(self.cfg.route_field)
            if isinstance(v, str) and v:
                key = v
        spec = self.cfg.task_plugins.get(key, key)
        if isinstance(spec, str):
            return spec, None
        return "+".join(spec), spec

    async def _instance(self, name: str) -> P.RewardPlugin | str:
        """The plugin named ``name``, built on first use when it is a type with default options; else
        the failure reason."""
        if name in self.instances:
            return self.instances[name]
        if name in self.init_errors:
            return self.init_errors[name]
        if name not in self.known:
            return "unknown_plugin"
        try:
            inst = self._build(name, PluginConfig(type=name))
            await inst.start()
        except Exception as e:  # a plugin that cannot start fails its items visibly, every time
            self.instances.pop(name, None)
            self.init_errors[name] = f"plugin_init_error: {type(e).__name__}: {e}"[:300]
            log.error("plugin %s cannot start: %s", name, e)
            return self.init_errors[name]
        return inst

    async def _run_plugin(self, name: str, items: list[P.Item]) -> list[P.Result]:
        inst = await self._instance(name)
        if isinstance(inst, str):
            out = [P.Result.failed(inst)] * len(items)
            self.metrics.items.labels(name, "failed", reason_code(inst)).inc(len(items))
            return out
        use_cache = self.cfg.cache_size > 0 and self.cacheable.get(name, True)
        results: list[P.Result | None] = [None] * len(items)
        todo = list(range(len(items)))
        keys: list[bytes] = []
        if use_cache:
            keys = [content_key(name, it) for it in items]
            todo = []
            for i, k in enumerate(keys):
                hit = self.cache.get(k)
                if hit is None:
                    todo.append(i)
                else:
                    self.cache.move_to_end(k)
                    results[i] = hit
            self.metrics.cache.labels(name, "hit").inc(len(items) - len(todo))
            self.metrics.cache.labels(name, "miss").inc(len(todo))
        if todo:
            batch = [items[i] for i in todo]
            t0 = time.perf_counter()
            try:
                out = await inst.score(batch)
                if not isinstance(out, list) or len(out) != len(batch):
                    raise ValueError(
                        f"plugin returned {len(out) if isinstance(out, list) else type(out).__name__} "
                        f"results for {len(batch)} items"
                    )
            except Exception as e:  # a plugin bug fails its items visibly; the service keeps serving
                log.exception("plugin %s failed on a batch of %d", name, len(batch))
                out = [P.Result.failed(f"plugin_error: {type(e).__name__}: {e}"[:300])] * len(batch)
            self.metrics.latency.labels(name).observe(time.perf_counter() - t0)
            for i, r in zip(todo, out):
                r = _checked(r)
                results[i] = r
                if use_cache and r.status == "ok":
                    self.cache[keys[i]] = r
            if use_cache:
                while len(self.cache) > self.cfg.cache_size:
                    self.cache.popitem(last=False)
        counts: dict[tuple[str, str], int] = {}
        for r in results:
            k = (r.status, reason_code(r.reason) if r.status != "ok" else "")
            counts[k] = counts.get(k, 0) + 1
        for (status, code), n in counts.items():
            self.metrics.items.labels(name, status, code).inc(n)
        return results

    async def score(self, items: list[P.Item]) -> list[ResultOut]:
        routes = [self.route(it) for it in items]
        need: dict[str, list[int]] = {}
        for i, (label, weights) in enumerate(routes):
            for name in weights or [label]:
                need.setdefault(name, []).append(i)
        names = list(need)
        outs = await asyncio.gather(*(self._run_plugin(n, [items[i] for i in need[n]]) for n in names))
        per: dict[str, dict[int, P.Result]] = {n: dict(zip(need[n], o)) for n, o in zip(names, outs)}
        scored = []
        for i, (label, weights) in enumerate(routes):
            if weights is None:
                r = per[label][i]
                scored.append(
                    ResultOut(score=r.score, status=r.status, reason=r.reason, plugin=label, details=r.details)
                )
                continue
            total, details, failed = 0.0, {}, None
            for name, w in weights.items():
                r = per[name][i]
                if r.status != "ok":
                    failed = failed or f"{r.reason} (from {name})"
                    continue
                total += w * r.score
                details[name] = r.score
                details.update({f"{name}.{k}": v for k, v in r.details.items()})
            if not failed and abs(total) > REWARD_LIMIT:
                failed = f"invalid_score: the weighted sum {total:g} is outside [-{REWARD_LIMIT:g}, {REWARD_LIMIT:g}]"
            if failed:
                scored.append(ResultOut(score=None, status="failed", reason=failed, plugin=label, details=details))
            else:
                scored.append(ResultOut(score=total, status="ok", plugin=label, details=details))
        return scored


def _checked(r) -> P.Result:
    """A plugin's result, or a failed one saying what was wrong with it."""
    if not isinstance(r, P.Result):
        return P.Result.failed(f"plugin_error: returned {type(r).__name__}, not a Result")
    if r.status == "failed":
        return (
            r if r.score is None and r.reason else P.Result.failed(r.reason or "plugin_error: failed without a reason")
        )
    if r.status != "ok":
        return P.Result.failed(f"plugin_error: unknown status {r.status!r}")
    if isinstance(r.score, bool) or not isinstance(r.score, (int, float)) or not math.isfinite(r.score):
        return P.Result.failed(f"invalid_score: {r.score!r} is not a finite number")
    if abs(r.score) > REWARD_LIMIT:  # the group message's bound (docs/protocol.md 3.2): the broker would refuse it
        return P.Result.failed(f"invalid_score: {r.score!r} is outside [-{REWARD_LIMIT:g}, {REWARD_LIMIT:g}]")
    return r
