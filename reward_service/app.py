"""The reward service's HTTP API (contract in docs/rewards.md; pinned by tests/snapshots/reward_openapi.json).

POST /score    ScoreRequest {"items": [ItemIn, ...]}  ->  ScoreResponse {"results": [ResultOut, ...]}  (same
               order, same length; the types are in broker/protocol/messages.py, shared with the generators)
GET  /plugins  plugin types, configured instances and the routing
GET  /healthz  "ok"
GET  /metrics  Prometheus text format

Guards: ``auth_token`` (bearer token on /score), ``max_request_bytes`` (413 before the body is
parsed), ``max_batch`` (413). A plugin's failure is a failed item in a 200 reply, never an error
of the whole request and never a silent 0.
"""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from broker.protocol.messages import ScoreRequest, ScoreResponse
from broker.runtime.metrics import render
from reward_service import plugins as P
from reward_service.config import RewardConfig  # noqa: F401  (callers import RewardConfig from here)
from reward_service.scoring import Scorer

log = logging.getLogger("relay.reward")


class BodyLimit:
    """ASGI middleware: 413 for a body over ``limit`` bytes, by Content-Length or while streaming."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(send)
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:  # FastAPI turns this into the 413 reply while it reads the body
                    raise HTTPException(413, f"request body exceeds max_request_bytes ({self.limit})")
            return msg

        async def tracked_send(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except HTTPException as e:  # raised by counted_receive outside a route that handles it
            if e.status_code != 413 or started:
                raise
            await self._reject(send)

    async def _reject(self, send):
        body = f'{{"detail":"request body exceeds max_request_bytes ({self.limit})"}}'.encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def create_app(cfg: RewardConfig) -> FastAPI:
    scorer = Scorer(cfg)

    @asynccontextmanager
    async def lifespan(_app):
        await scorer.start()
        yield
        await scorer.close()

    app = FastAPI(title="Relay reward service", version="2", lifespan=lifespan,
                  description="Batch scoring through reward plugins; a failure is a failed item, never a silent 0.")
    app.state.scorer = scorer
    app.add_middleware(BodyLimit, limit=cfg.max_request_bytes)
    bearer = HTTPBearer(auto_error=False, description="required when the service has an auth_token")

    def authorize(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not cfg.auth_token:
            return
        if cred is None or not hmac.compare_digest(cred.credentials.encode(), cfg.auth_token.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    @app.post("/score", response_model=ScoreResponse, dependencies=[Depends(authorize)],
              responses={401: {"description": "missing or wrong bearer token"},
                         413: {"description": "request body or batch too large"}})
    async def score(req: ScoreRequest) -> ScoreResponse:
        if len(req.items) > cfg.max_batch:
            raise HTTPException(413, f"batch of {len(req.items)} items exceeds max_batch {cfg.max_batch}")
        items = [P.Item(it.prompt, it.completion, it.reference, it.finished, it.task, it.metadata, it.num_tokens)
                 for it in req.items]
        return ScoreResponse(results=await scorer.score(items))

    @app.get("/plugins")
    async def plugins() -> dict:
        return {"plugins": sorted(scorer.known),
                "instances": {n: i.name for n, i in sorted(scorer.instances.items())},
                "task_plugins": cfg.task_plugins, "route_field": cfg.route_field}

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> str:
        return "ok\n"

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        # every sample labelled service="reward", replica="0", as every Relay service does (broker/runtime/metrics.py)
        return render("reward", "0", scorer.metrics.registry).decode()

    return app
