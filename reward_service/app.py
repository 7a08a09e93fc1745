"""The reward service's HTTP API (contract in docs/rewards.md; pinned by tests/snapshots/reward_openapi.json).

POST /score    ScoreRequest {"items": [ItemIn, ...]}  ->  ScoreResponse {"results": [ResultOut, ...]}  (same
               order, same length; the types are in broker/protocol/messages.py, shared with the generators)
GET  /plugins  plugin types, configured instances and the routing
GET  /healthz  "ok"
GET  /metrics  Prometheus text format

Guards, outermost first: ``auth_token`` (the bearer token on /score, checked from the headers before
one byte of the body is read: 401), ``max_request_bytes`` (413 by Content-Length, or as soon as a
streamed body passes it: never read whole), ``max_batch`` (413). A client that goes away while its
batch is scored has the scoring cancelled (counted in ``relay_reward_abandoned_requests_total``).
A plugin's failure is a failed item in a 200 reply, never an error of the whole request and never a
silent 0.
"""

from __future__ import annotations

import asyncio
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


def token_ok(headers: list[tuple[bytes, bytes]], token: str) -> bool:
    """Whether the raw ASGI ``headers`` carry ``Authorization: Bearer <token>`` (compared in constant time)."""
    value = dict(headers).get(b"authorization", b"")
    scheme, _, given = value.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token.encode())


class AuthFirst:
    """ASGI middleware: a request to one of ``paths`` without the bearer ``token`` is answered 401 from its
    headers alone; its body is never read (nor its Content-Length believed). Outermost, before the body limit."""

    def __init__(self, app, token: str, paths: tuple[str, ...] = ("/score",)):
        self.app, self.token, self.paths = app, token, paths

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or not self.token
            or scope["path"] not in self.paths
            or token_ok(scope.get("headers") or [], self.token)
        ):
            return await self.app(scope, receive, send)
        body = b'{"detail":"missing or wrong bearer token"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class CancelOnDisconnect:
    """ASGI middleware: once a request's body has been read, watch the connection; when the client goes
    away before the reply is complete, cancel the request's task (its scoring: pending plugin calls are
    cancelled, nothing more is started for it) and call ``abandoned()``. The app sees the disconnect
    through ``receive`` as usual."""

    def __init__(self, app, abandoned):
        self.app, self.abandoned = app, abandoned

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_read, gone = asyncio.Event(), asyncio.Event()
        replied = False

        async def app_receive():
            if body_read.is_set():  # after the body only the disconnect comes; the watcher reads it
                await gone.wait()
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.disconnect":
                gone.set()
            elif not msg.get("more_body", False):
                body_read.set()
            return msg

        async def app_send(msg):
            nonlocal replied
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                replied = True
            await send(msg)

        task = asyncio.ensure_future(self.app(scope, app_receive, app_send))

        async def watch():
            await body_read.wait()
            if (await receive())["type"] == "http.disconnect":
                gone.set()
                if not replied and not task.done():
                    task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await task
        except asyncio.CancelledError:
            if not (gone.is_set() and not replied):
                raise  # the server itself is cancelling us (shutdown)
            self.abandoned()
            log.info("client went away during %s %s: its work was cancelled", scope["method"], scope["path"])
        finally:
            watcher.cancel()


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
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def create_app(cfg: RewardConfig) -> FastAPI:
    scorer = Scorer(cfg)
    if not cfg.auth_token:  # allowed on loopback only (RewardConfig), where other local users still reach it
        log.warning(
            "no auth_token: any process that reaches %s:%s can call POST /score (relay up sets one per "
            "run; docs/rewards.md, Security)",
            cfg.host,
            cfg.port,
        )

    @asynccontextmanager
    async def lifespan(_app):
        await scorer.start()
        yield
        await scorer.close()

    app = FastAPI(
        title="Relay reward service",
        version="2",
        lifespan=lifespan,
        description="Batch scoring through reward plugins; a failure is a failed item, never a silent 0.",
    )
    app.state.scorer = scorer
    # the last added runs first: the token before the body limit before anything reads the body
    app.add_middleware(CancelOnDisconnect, abandoned=scorer.metrics.abandoned.inc)
    app.add_middleware(BodyLimit, limit=cfg.max_request_bytes)
    app.add_middleware(AuthFirst, token=cfg.auth_token)
    bearer = HTTPBearer(auto_error=False, description="required when the service has an auth_token")

    def authorize(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not cfg.auth_token:
            return
        if cred is None or not hmac.compare_digest(cred.credentials.encode(), cfg.auth_token.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    @app.post(
        "/score",
        response_model=ScoreResponse,
        dependencies=[Depends(authorize)],
        responses={
            401: {"description": "missing or wrong bearer token"},
            413: {"description": "request body or batch too large"},
        },
    )
    async def score(req: ScoreRequest) -> ScoreResponse:
        if len(req.items) > cfg.max_batch:
            raise HTTPException(413, f"batch of {len(req.items)} items exceeds max_batch {cfg.max_batch}")
        items = [
            P.Item(it.prompt, it.completion, it.reference, it.finished, it.task, it.metadata, it.num_tokens)
            for it in req.items
        ]
        return ScoreResponse(results=await scorer.score(items))

    @app.get("/plugins")
    async def plugins() -> dict:
        return {
            "plugins": sorted(scorer.known),
            "instances": {n: i.name for n, i in sorted(scorer.instances.items())},
            "task_plugins": cfg.task_plugins,
            "route_field": cfg.route_field,
        }

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> str:
        return "ok\n"

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        # every sample labelled service="reward", replica="0", as every Relay service does (broker/runtime/metrics.py)
        return render("reward", "0", scorer.metrics.registry).decode()

    return app
