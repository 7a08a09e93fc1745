"""The reward service's HTTP API.

POST /score    {"items": [Item, ...]}  ->  {"results": [Result, ...]}  (same order, same length)
GET  /plugins  registered plugin names and the task -> plugin mapping
GET  /healthz  "ok"
GET  /metrics  Prometheus text format
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, Field

from broker.config import StrictModel
from reward_service import plugins as P

log = logging.getLogger("relay.reward")


class RewardConfig(StrictModel):
    """The reward service: where it listens and which plugin scores which task."""

    host: str = Field("127.0.0.1", description="bind address; 127.0.0.1 unless you need remote callers")
    port: int = Field(8090, ge=0, le=65535, description="HTTP port")
    task_plugins: dict[str, str] = Field(
        default_factory=lambda: {"copy": "digits", "reverse": "digits", "add": "digits"},
        description="task name -> plugin name; a task not listed uses the plugin of the same name")
    max_batch: int = Field(4096, ge=1, description="largest accepted batch")


class ItemIn(BaseModel):
    prompt: str = ""
    completion: str
    reference: str = ""
    finished: bool = True
    task: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class ScoreRequest(BaseModel):
    items: list[ItemIn]


class ResultOut(BaseModel):
    score: float | None
    status: str
    reason: str = ""
    plugin: str = ""
    details: dict[str, float] = Field(default_factory=dict)


class ScoreResponse(BaseModel):
    results: list[ResultOut]


def create_app(cfg: RewardConfig) -> FastAPI:
    P.load_entry_point_plugins()
    instances: dict[str, P.RewardPlugin] = {}
    registry = CollectorRegistry()
    m_items = Counter("relay_reward_items", "items scored, by plugin and status", ["plugin", "status", "reason"],
                      registry=registry)
    m_latency = Histogram("relay_reward_batch_seconds", "scoring latency per plugin batch", ["plugin"],
                          registry=registry)
    app = FastAPI(title="Relay reward service", version="1")

    def plugin_for(task: str) -> str:
        return cfg.task_plugins.get(task, task)

    @app.post("/score", response_model=ScoreResponse)
    async def score(req: ScoreRequest) -> ScoreResponse:
        if len(req.items) > cfg.max_batch:
            raise HTTPException(413, f"batch of {len(req.items)} items exceeds max_batch {cfg.max_batch}")
        results: list[ResultOut | None] = [None] * len(req.items)
        by_plugin: dict[str, list[int]] = {}
        for i, it in enumerate(req.items):
            by_plugin.setdefault(plugin_for(it.task), []).append(i)
        for name, idx in by_plugin.items():
            if name not in P.REGISTRY:
                for i in idx:
                    results[i] = ResultOut(score=None, status="failed", reason="unknown_plugin", plugin=name)
                m_items.labels(name, "failed", "unknown_plugin").inc(len(idx))
                continue
            plugin = instances.setdefault(name, P.REGISTRY[name]())
            batch = [P.Item(**req.items[i].model_dump()) for i in idx]
            t0 = time.perf_counter()
            try:
                out = await plugin.score(batch)
                if len(out) != len(batch):
                    raise ValueError(f"plugin returned {len(out)} results for {len(batch)} items")
            except Exception as e:  # a plugin bug fails its items visibly; the service keeps serving
                log.exception("plugin %s failed on a batch of %d", name, len(batch))
                out = [P.Result.failed(f"plugin_error: {type(e).__name__}: {e}"[:200]) for _ in batch]
            m_latency.labels(name).observe(time.perf_counter() - t0)
            for i, r in zip(idx, out):
                results[i] = ResultOut(score=r.score, status=r.status, reason=r.reason, plugin=name, details=r.details)
                m_items.labels(name, r.status, r.reason.split(":")[0]).inc()
        return ScoreResponse(results=results)

    @app.get("/plugins")
    async def plugins() -> dict:
        return {"plugins": sorted(P.REGISTRY), "task_plugins": cfg.task_plugins}

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> str:
        return "ok\n"

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        return generate_latest(registry).decode()

    return app
