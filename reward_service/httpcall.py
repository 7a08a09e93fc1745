"""Outbound HTTP for plugins that call other servers (remote reward servers, LLM judges) and for the
remote environment of multi-turn episodes (generators/envs/remote.py).

One :class:`HttpCaller` per plugin instance: a timeout per attempt, retries with exponential
back-off and jitter, a limit on requests in flight, and a circuit breaker. Every way a call can fail
ends in :class:`CallFailed` with a short ``code`` (timeout, unreachable, http_500, malformed,
circuit_open, ...) that the plugin turns into a failed item; nothing is swallowed.

Retried: timeouts, connection errors, HTTP 5xx and 429. Not retried: other 4xx (the request is
wrong, or the token: 401), a 2xx whose body is not JSON (the server is wrong; retrying would not
help) and a server whose certificate fails verification or its pin (``tls_unverified``:
reward_service/tls.py). The circuit breaker counts only what says the server is out (the retried
failures): a 4xx or a reply that is not JSON came from a server that is up, so it fails the call
without opening the breaker (it counts as an answer: a half-open breaker closes). A wrong token or a
server answering garbage is then a visible failure of every item, never taken for an outage. Plain
http goes only to a loopback host unless ``allow_plain_http``: the requests carry the token, prompts
and references.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from typing import Any

import httpx
from pydantic import Field, model_validator

from broker.client.connection import Backoff
from broker.runtime.config import StrictModel
from reward_service.tls import check_transport, is_tls_failure, tls_context


class Observer:
    """What a caller reports besides its replies (the reward service plugs in its metrics, the remote
    environment its counters). Defined here, not with the reward plugins, so that any component can
    make outbound calls without importing the reward plugins."""

    def request(self, outcome: str) -> None:
        """One outbound request finished with ``outcome`` (ok, timeout, http_500, ...)."""

    def circuit(self, state: str) -> None:
        """The circuit breaker is now ``closed``, ``open`` or ``half_open``."""


class HttpOptions(StrictModel):
    """How a plugin calls a remote server (shared by ``remote`` and ``judge``, and the ``remote`` environment)."""

    timeout_s: float = Field(5.0, gt=0, le=3600, description="timeout of one attempt (connect + read)")
    retries: int = Field(
        2, ge=0, le=20, description="retries after a failed attempt (timeouts, connection errors, 5xx, 429)"
    )
    backoff_s: float = Field(0.2, ge=0, le=60, description="first retry delay; doubles each retry (with jitter)")
    backoff_max_s: float = Field(5.0, ge=0, le=600, description="longest retry delay")
    max_concurrency: int = Field(4, ge=1, le=1024, description="requests in flight to this server at most")
    breaker_failures: int = Field(
        5,
        ge=1,
        description="consecutive failed attempts that open the circuit breaker "
        "(timeouts, connection errors, 5xx, 429; a 4xx or a reply that is not JSON does "
        "not count)",
    )
    breaker_reset_s: float = Field(
        10.0, gt=0, description="seconds the breaker stays open before one trial request (half-open)"
    )
    token_env: str = Field(
        "",
        description="name of an environment variable holding a bearer token for the "
        "remote (preferred over `token`: keeps the secret out of config files)",
    )
    token: str = Field("", description="bearer token for the remote, inline")
    headers: dict[str, str] = Field(default_factory=dict, description="extra request headers")
    ca_file: str = Field(
        "",
        description="https: PEM file of the certificates to verify the server against "
        "(a private CA, or the server's own self-signed certificate) instead of the system's CAs",
    )
    pin_sha256: str = Field(
        "",
        pattern=r"^([0-9a-f]{64})?$",
        description="https: SHA-256 of the server "
        "certificate's DER bytes (64 lowercase hex digits); any other certificate is refused "
        "before the request is sent, on top of the CA check (`openssl x509 -in cert.pem "
        "-outform der | sha256sum`)",
    )
    allow_plain_http: bool = Field(
        False,
        description="accept an http:// url to a host that is not loopback (the "
        "token, prompts and reference answers then travel unencrypted to whoever holds "
        "that address); refused otherwise",
    )

    @model_validator(mode="after")
    def _transport(self) -> "HttpOptions":
        url = getattr(self, "url", None) or getattr(self, "base_url", None)  # remote and environment; judge
        if isinstance(url, str):
            check_transport(url, self.ca_file, self.pin_sha256, self.allow_plain_http)
        return self


def resolve_token(opts: HttpOptions) -> str:
    """The bearer token: the variable ``token_env`` names (which must be set), else ``token``. Called
    by the plugin at start and by ``relay up`` before anything starts."""
    if opts.token_env:
        token = os.environ.get(opts.token_env, "")
        if not token:
            raise ValueError(
                f"token_env names {opts.token_env!r}, which is not set in the environment: "
                f"export {opts.token_env}=<token> before starting"
            )
        return token
    return opts.token


class CallFailed(Exception):
    def __init__(self, code: str, detail: str = ""):
        super().__init__(f"{code}: {detail}" if detail else code)
        self.code = code
        self.detail = detail


class CircuitBreaker:
    """closed -> (``failures`` consecutive failures) -> open -> (``reset_s``) -> half_open: one
    trial call; success closes, failure reopens."""

    def __init__(self, failures: int, reset_s: float, clock=time.monotonic, on_change=None):
        self.failures, self.reset_s, self.clock = failures, reset_s, clock
        self.on_change = on_change or (lambda state: None)
        self.state = "closed"
        self.consecutive = 0
        self.opened_at = 0.0
        self.trial_in_flight = False

    def allow(self) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open" and self.clock() - self.opened_at >= self.reset_s:
            self._set("half_open")
        if self.state == "half_open" and not self.trial_in_flight:
            self.trial_in_flight = True
            return True
        return False

    def record(self, ok: bool) -> None:
        self.trial_in_flight = False
        if ok:
            self.consecutive = 0
            if self.state != "closed":
                self._set("closed")
            return
        self.consecutive += 1
        if self.state == "half_open" or self.consecutive >= self.failures:
            self.opened_at = self.clock()
            if self.state != "open":
                self._set("open")

    def _set(self, state: str) -> None:
        self.state = state
        self.on_change(state)


class HttpCaller:
    def __init__(self, url: str, opts: HttpOptions, observer: Observer | None = None):
        self.url, self.opts = url, opts
        self.observer = observer or Observer()
        self.breaker = CircuitBreaker(opts.breaker_failures, opts.breaker_reset_s, on_change=self.observer.circuit)
        self.sem: asyncio.Semaphore | None = None
        self.client: httpx.AsyncClient | None = None
        self.headers = dict(opts.headers)
        token = resolve_token(opts)
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def _ensure(self) -> None:
        if self.client is None:  # created in the event loop that uses it
            self.sem = asyncio.Semaphore(self.opts.max_concurrency)
            self.client = httpx.AsyncClient(
                timeout=self.opts.timeout_s,
                headers=self.headers,
                limits=httpx.Limits(max_connections=self.opts.max_concurrency),
                verify=tls_context(self.opts.ca_file, self.opts.pin_sha256),
            )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    async def post_json(self, payload: Any, path: str = "") -> Any:
        """POST ``payload`` as JSON; the parsed JSON reply, or CallFailed."""
        self._ensure()
        body = json.dumps(payload).encode()
        last: CallFailed | None = None
        backoff = Backoff(self.opts.backoff_s, self.opts.backoff_max_s)
        for attempt in range(self.opts.retries + 1):
            if attempt:
                delay = backoff.delay(attempt)
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
            if not self.breaker.allow():
                self.observer.request("circuit_open")
                if last is not None:  # this call did reach the server: report what actually went wrong
                    raise last
                raise CallFailed(
                    "circuit_open",
                    f"{self.breaker.consecutive} consecutive failures; retrying after {self.opts.breaker_reset_s}s",
                )
            try:
                async with self.sem:
                    resp = await self.client.post(
                        self.url + path, content=body, headers={"Content-Type": "application/json"}
                    )
            except httpx.TimeoutException as e:
                last = CallFailed("timeout", f"no reply within {self.opts.timeout_s}s ({type(e).__name__})")
            except httpx.TransportError as e:
                if is_tls_failure(e):  # not the server we were told to trust: nothing was sent, never retried
                    last = CallFailed("tls_unverified", f"{type(e).__name__}: {e}"[:300])
                    self.breaker.record(False)
                    self.observer.request(last.code)
                    raise last from None
                last = CallFailed("unreachable", f"{type(e).__name__}: {e}"[:200])
            else:
                if resp.status_code == 200:
                    try:
                        data = resp.json()
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        self.breaker.record(True)  # it answered: not an outage (the module's docstring)
                        self.observer.request("malformed")
                        raise CallFailed(
                            "malformed", f"reply is not JSON: {e}; body starts {resp.text[:80]!r}"
                        ) from None
                    self.breaker.record(True)
                    self.observer.request("ok")
                    return data
                last = CallFailed(f"http_{resp.status_code}", resp.text[:200])
                if resp.status_code < 500 and resp.status_code != 429:
                    self.breaker.record(True)  # it answered (a wrong request or token): not an outage
                    self.observer.request(last.code)
                    raise last
            self.breaker.record(False)
            self.observer.request(last.code)
        raise last
