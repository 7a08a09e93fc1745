"""The generator's OpenAI-compatible endpoint (docs/openai-endpoint.md): an external agent harness, any
program using the ``openai`` client, samples from this generator's model; every call of a session is
recorded token-in-token-out (generators/sessions.py), and once the sessions of a group have their rewards
the group goes to the broker through the sink like any other group.

Served (non-streaming): ``GET /v1/models``, ``POST /v1/chat/completions`` (messages, tools: rendered by
the tokenizer's chat template; Hermes-style ``<tool_call>{json}</tool_call>`` in the sampled text comes
back as ``tool_calls``), ``POST /v1/completions`` and ``POST /v1/relay/sessions/{id}/reward``.

Access: every request needs ``Authorization: Bearer <openai.api_key>`` (401 without it, before anything is
read or sampled) unless ``openai.open``; every POST must be ``Content-Type: application/json`` (415
otherwise: a web page can post ``text/plain`` cross-site without a preflight, never JSON); no CORS header is
ever sent. A reward the caller posts is trained as given and marked ``source: caller`` in the sample's
reward details; ``openai.reward_source = "reward_service"`` refuses posted numbers (403).

Each response names the weight version that sampled it (``relay.weight_version``, ``X-Relay-Weight-Version``)
and, on request (``logprobs``), the behaviour log-prob of each sampled token: the very number trained.

Sampling: the learner recomputes the behaviour log-probs with one sampling transform per run, so a
request may not change temperature, top_p or top_k: a different value is refused (400) or, with
``openai.sampling_mismatch = "override"``, replaced by the generator's (said in ``X-Relay-Sampling``).
``max_tokens`` is honoured up to ``openai.max_tokens``.

Concurrency: the engine is not thread-safe. The generator owns one re-entrant engine lock: its weight
applier holds it while it updates, and every caller of the backend's ``generate`` (the main loop's batches,
evaluation rounds, episodes, these requests) holds it while it samples, so a call's weight version is the
one that really sampled it.

The pieces: this module serves (the routes, the access rules, :func:`start`); the handlers and their state
are generators/openai_endpoint.py (which sees of the generator only its ``EndpointContext``), reading a
request generators/openai_requests.py, an answer's extras generators/openai_answers.py, a session's reward
and group generators/openai_groups.py, the counters generators/openai_metrics.py; chats are rendered by
generators/chat_render.py and tool calls parsed by generators/tool_calls.py, as the episodes do.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading

from fastapi import FastAPI, Request  # module level: the routes' annotations are resolved from here
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from generators.openai_answers import is_json
from generators.openai_endpoint import EndpointContext, OpenAIEndpoint
from generators.sessions import SessionError

log = logging.getLogger("relay.generator.openai")

UNAUTHORIZED = (
    "a valid 'Authorization: Bearer <openai.api_key>' is required (relay up keeps the run's key in "
    "runs/<id>/secrets/openai.key)"
)


def error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def authorized(request: Request, key: bytes, open_: bool) -> bool:
    if open_:
        return True
    auth = request.headers.get("authorization", "")  # an empty key matches nothing (fail closed)
    return bool(key) and auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].encode(), key)


async def json_body(request: Request) -> dict | tuple[str, JSONResponse]:
    """The request's JSON object, or (outcome, the refusal): a body that is not JSON sent as JSON."""
    ctype = request.headers.get("content-type", "")
    if not is_json(ctype):
        return "unsupported_media_type", error(
            415,
            f"the body must be JSON sent with 'Content-Type: application/json', got "
            f"{ctype[:100]!r}: other types are refused (a web page can post them from any site)",
        )
    try:
        data = await request.json()
    except ValueError:
        return "bad_request", error(400, "the body must be JSON")
    if not isinstance(data, dict):
        return "bad_request", error(400, "the body must be a JSON object")
    return data


def handler(ep: OpenAIEndpoint):
    """``handle(request, name, fn, *args, body=True)``: the access rules, then ``fn`` off the event loop
    (with the request's headers and JSON body unless ``body`` is false), every outcome counted."""
    key, open_, count = ep.cfg.api_key.encode(), ep.cfg.open, ep.counters.count

    async def handle(request: Request, name: str, fn, *args, body: bool = True):
        if not authorized(request, key, open_):
            count(name, "unauthorized")
            return error(401, UNAUTHORIZED)
        data = None
        if body:
            data = await json_body(request)
            if isinstance(data, tuple):
                count(name, data[0])
                return data[1]
        try:  # sampling blocks: off the event loop
            status, out, headers = await run_in_threadpool(fn, *args, *([request.headers, data] if body else []))
        except SessionError as e:
            count(name, f"error_{e.status}")
            return error(e.status, str(e))
        except Exception as e:  # noqa: BLE001 - an engine or template failure: logged, counted, answered 500
            log.exception("%s request failed", name)
            count(name, "error_500")
            return error(500, f"{type(e).__name__}: {e}"[:500])
        count(name, "ok")
        return JSONResponse(out, status_code=status, headers=headers)

    return handle


def create_app(ep: OpenAIEndpoint) -> FastAPI:
    """The routes. No CORS middleware: a browser on another origin gets no ``Access-Control-Allow-*`` header,
    so it can neither read an answer nor send the preflight a JSON POST needs."""
    app = FastAPI(title="Relay generator: OpenAI-compatible endpoint", docs_url=None, redoc_url=None)
    handle = handler(ep)

    @app.get("/v1/models")
    async def models(request: Request):
        return await handle(request, "models", ep.models, body=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat", ep.chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions", ep.completions)

    @app.post("/v1/relay/sessions/{sid}/reward")
    async def reward(sid: str, request: Request):
        return await handle(request, "reward", lambda _headers, data: ep.reward(sid, data))

    @app.get("/v1/relay/sessions/{sid}")
    async def info(sid: str, request: Request):
        return await handle(request, "session", lambda: ep.session_info(sid), body=False)

    return app


def start(ctx: EndpointContext) -> OpenAIEndpoint:
    """Serve the endpoint on its own thread (``cfg.openai.host:port``; port 0 picks one), with the
    idle-session reaper, and emit an ``openai_endpoint`` event with the URL."""
    import uvicorn

    cfg = ctx.cfg
    ep = OpenAIEndpoint(ctx)
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as e:
        raise OSError(
            f"cannot serve the OpenAI endpoint on {cfg.host}:{cfg.port}: {e.strerror} (set openai.port; "
            "0 picks a free one)"
        ) from None
    ep.port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(ep), log_level="warning", access_log=False, log_config=None))
    ep.server = server
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="openai-http", daemon=True).start()
    threading.Thread(target=ep.reap, name="openai-reaper", daemon=True).start()
    url = f"http://{cfg.host}:{ep.port}/v1"
    log.info(
        "OpenAI-compatible endpoint on %s (sessions of %d per group; %s; rewards from %s)",
        url,
        cfg.group_size,
        "open: no key" if cfg.open else "Authorization: Bearer <openai.api_key>",
        cfg.reward_source,
    )
    if cfg.open:
        log.warning(
            "the OpenAI endpoint on %s is OPEN (openai.open = true): anyone who reaches this port samples from "
            "the model and trains it with the rewards they post; give it a key (RELAY_OPENAI__API_KEY) "
            "unless this machine is yours alone",
            url,
        )
    ctx.emit(
        "openai_endpoint",
        generator=ctx.generator_id,
        url=url,
        auth="none" if cfg.open else "bearer",
        reward_source=cfg.reward_source,
    )
    return ep
