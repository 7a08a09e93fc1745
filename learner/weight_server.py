"""The ``http`` weight transport, learner side: the leader serves its weight store read-only over HTTP.

``GET``/``HEAD /v000012/<file>`` serves one file of a sealed version: ``manifest.json`` or a plain
file its manifest lists; anything else (another path, a name the manifest does not list, a symbolic
link, a folder still being written, a version pruned meanwhile) is 404. One byte range per request
(``Range: bytes=a-b``, ``a-``, ``-n``) is answered 206; a range that cannot be satisfied or parsed,
or several ranges, 416. Files are immutable once sealed, so the ``ETag`` of a listed file is its
sha256 from the manifest, and a client that resumes a download with a Range request gets the same
bytes.

Integrity is not this server's job: a generator checks the manifest against the hash in the signed
announcement and every file against the manifest (generators/weight_fetch.py). Confidentiality is:
with the run's weights key, every request must carry ``Authorization: Bearer <token>`` where the
token is derived from that key (broker/protocol/weightauth.py), so only the learner and the generators
read the weights (docs/security.md); without it (``weights.auth = "insecure"``) anyone who reaches the
port does. It binds ``weights.transport.host`` (127.0.0.1 by default).

Bounded like the other servers (broker/runtime/httpserver.py): a fixed pool of worker threads, a cap
on open connections, a deadline on each request head and on each write.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import stat
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from broker.protocol import weightstore
from broker.protocol.weightauth import bearer_token
from broker.protocol.weights_config import HttpTransport
from broker.runtime.httpserver import BoundedHTTPServer
from learner.transports import Sender, SenderContext

log = logging.getLogger("relay.learner.weight_server")

_PATH = re.compile(r"^/(v\d{6,})/([A-Za-z0-9_][A-Za-z0-9._-]{0,254})$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
CHUNK = 1 << 20


class RangeError(ValueError):
    """A Range header that cannot be served (416)."""


def parse_range(header: str, size: int) -> tuple[int, int]:
    """``(start, end)`` (end exclusive) of a single byte range of a file of ``size`` bytes; RangeError
    when it is malformed, asks several ranges, or lies outside the file."""
    m = _RANGE.match(header.strip())
    if m is None:
        raise RangeError(f"unsupported range {header!r} (one range, bytes=a-b, a- or -n)")
    first, last = m.group(1), m.group(2)
    if first == "" and last == "":
        raise RangeError("empty range")
    if first == "":  # the last n bytes
        n = int(last)
        if n == 0 or size == 0:
            raise RangeError(f"range {header!r} of a {size}-byte file")
        return max(0, size - n), size
    start = int(first)
    end = min(int(last) + 1, size) if last != "" else size
    if start >= size or end <= start:
        raise RangeError(f"range {header!r} outside a {size}-byte file")
    return start, end


class WeightServer:
    """Serves the weight store ``store`` on ``(host, port)`` (port 0: a free one). :meth:`start`,
    :meth:`url` for an announcement, :meth:`close`. ``token``: the bearer token every request must
    carry (None: none asked). Counts requests by status and bytes sent (``counts``)."""

    def __init__(
        self,
        store: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        advertise_url: str = "",
        workers: int = 8,
        max_connections: int = 64,
    ):
        self.store = Path(store).resolve()
        self.token = token
        self.counts: Counter = Counter()
        self._lock = threading.Lock()
        self._manifests: dict[str, dict] = {}  # version folder name -> its manifest (sealed folders never change)
        self.http = BoundedHTTPServer(
            (host, port),
            _handler(self),
            workers=workers,
            max_connections=max_connections,
            head_timeout_s=10.0,
            write_timeout_s=60.0,
        )
        bound_host, bound_port = self.http.server_address
        self.base_url = (advertise_url or f"http://{_url_host(bound_host)}:{bound_port}").rstrip("/")

    def start(self) -> "WeightServer":
        self.http.start(name="weight-server")
        log.info(
            "serving the weight store %s at %s%s",
            self.store,
            self.base_url,
            " (bearer token required)" if self.token else " (no authentication: weights.auth insecure)",
        )
        return self

    def url(self, version: int) -> str:
        """The base URL of version ``version``'s files (the announcement's ``url``)."""
        return f"{self.base_url}/v{version:06d}/"

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    # -- what may be served ---------------------------------------------------------------------------

    def manifest(self, folder: str) -> dict | None:
        """The manifest of the sealed version folder ``folder`` of the store (None: not one)."""
        with self._lock:
            cached = self._manifests.get(folder)
        if cached is not None:
            return cached
        path = self.store / folder
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):  # a symbolic link is not a version folder
                return None
            manifest = weightstore.read_manifest(path)
        except (OSError, weightstore.WeightStoreError):
            return None
        with self._lock:
            if len(self._manifests) > 64:
                self._manifests.clear()
            self._manifests[folder] = manifest
        return manifest

    def open(self, request_path: str):
        """``(file object, size, etag)`` of the file ``request_path`` names, or None (404)."""
        m = _PATH.match(request_path)
        if m is None:
            return None
        folder, name = m.group(1), m.group(2)
        manifest = self.manifest(folder)
        if manifest is None or (name != weightstore.MANIFEST and name not in manifest["files"]):
            return None
        try:
            fd = os.open(self.store / folder / name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # pruned meanwhile, or a symbolic link (ELOOP)
            with self._lock:
                self._manifests.pop(folder, None)
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        etag = manifest["files"].get(name) if name != weightstore.MANIFEST else None
        return os.fdopen(fd, "rb"), st.st_size, etag


def serve_store(store: str | Path, cfg: HttpTransport, weights_key: bytes | None, run_id: str) -> WeightServer:
    """The learner leader's weight server for ``weights.transport = "http"``, started (``weights_key``: the run's
    weights key, broker/protocol/weightauth.py; None: no token asked)."""
    return WeightServer(store, cfg.host, cfg.port, bearer_token(weights_key, run_id), cfg.advertise_url).start()


def wait_until_served(r, keys, version: int, timeout_s: float, fresh_s: float = 15.0) -> bool:
    """Block until every generator whose heartbeat is fresh (``fresh_s``) serves ``version`` or newer, at most
    ``timeout_s``: the learner's last version is fetched from its server, so the leader keeps serving
    until the generators have it (their final evaluation uses it) before the run is marked done."""
    from broker.client.telemetry import read_heartbeats

    deadline = time.monotonic() + timeout_s
    while True:
        now = time.time()
        behind = sorted(
            gid
            for gid, hb in read_heartbeats(r, keys).items()
            if hb.last_seen is not None
            and now - hb.last_seen < fresh_s
            and (hb.version is None or hb.version < version)
        )
        if not behind:
            return True
        if time.monotonic() >= deadline:
            log.warning(
                "stopped serving the weights with generator(s) %s still short of version %d after %.0fs",
                ", ".join(behind),
                version,
                timeout_s,
            )
            return False
        time.sleep(0.2)


class HttpSender(Sender):
    """``weights.transport = "http"``, learner side (learner/transports.py): the leader serves its weight
    store read-only (:class:`WeightServer`), each announcement names the version's URL there, and at the
    run's end it serves until the generators have the last version (at most ``weights.transport.linger_s``)."""

    name = "http"

    def __init__(self, ctx: SenderContext):
        super().__init__(ctx)
        cfg = ctx.cfg
        self.server: WeightServer | None = serve_store(
            cfg.weight_store, cfg.weights.transport, ctx.weights_key, cfg.run_id
        )

    def attach(self, publisher) -> None:
        publisher.url_for = self.server.url

    def finish(self, version: int) -> None:
        if self.server is not None:
            wait_until_served(self.ctx.r, self.ctx.keys, version, self.ctx.cfg.weights.transport.linger_s)
            self.server.close()
            self.server = None


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _handler(server: WeightServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "relay-weights"

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def _reply(self, code: int, message: str, headers: dict | None = None, body: bool = True) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)
            server.count(str(code))

        def _serve(self, body: bool) -> None:
            if server.token is not None:
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {server.token}".encode()):
                    self._reply(
                        401,
                        "a bearer token is required (derived from the run's weights key)",
                        {"WWW-Authenticate": "Bearer"},
                        body,
                    )
                    return
            found = server.open(self.path.split("?", 1)[0])
            if found is None:
                self._reply(404, "not a file of a published version", body=body)
                return
            f, size, etag = found
            with f:
                start, end, code = 0, size, 200
                if self.headers.get("Range") is not None:
                    try:
                        start, end = parse_range(self.headers["Range"], size)
                    except RangeError as e:
                        self._reply(416, str(e), {"Content-Range": f"bytes */{size}"}, body)
                        return
                    code = 206
                self.send_response(code)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(end - start))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Cache-Control", "private, immutable")
                if etag:
                    self.send_header("ETag", f'"{etag}"')
                if code == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
                self.end_headers()
                server.count(str(code))
                if body and end > start:
                    self.wfile.flush()
                    sent = self.connection.sendfile(f, start, end - start)
                    server.count("bytes_sent", sent)

        def log_message(self, fmt: str, *args) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

    return Handler
