"""A reward server written from docs/rewards.md alone, with the Python standard library only:
what a user of another language would write. Tests run it as a separate process.

    python tests/support/remote_reward_server.py --port 9000 [--token-env NAME]

POST /score    the contract of docs/rewards.md ("Remote plugins"): score = the length of the
               completion's common prefix with the reference / the reference's length (0 when the
               completion did not finish), details {"prefix": n}.
Test controls (not part of the contract):
POST /control  {"mode": "ok" | "500" | "hang" | "garbage"} changes how /score answers
GET  /stats    {"requests", "items_scored", "unauthorized", "mode"}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"mode": "ok", "requests": 0, "items_scored": 0, "unauthorized": 0}
LOCK = threading.Lock()
TOKEN = ""


def score_item(item: dict) -> dict:
    ref, comp = item.get("reference", ""), item.get("completion", "").strip()
    if not ref:
        return {"score": None, "status": "failed", "reason": "no_reference"}
    if not item.get("finished", True):
        return {"score": 0.0, "details": {"prefix": 0}}
    n = 0
    while n < min(len(ref), len(comp)) and ref[n] == comp[n]:
        n += 1
    return {"score": n / max(len(ref), len(comp)), "details": {"prefix": n}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def do_GET(self):
        if self.path == "/stats":
            with LOCK:
                return self._reply(200, json.dumps(STATE).encode())
        self._reply(404, b'{"detail": "not found"}')

    def do_POST(self):
        body = self._body()
        if self.path == "/control":
            with LOCK:
                STATE["mode"] = json.loads(body)["mode"]
            return self._reply(200, b"{}")
        if self.path != "/score":
            return self._reply(404, b'{"detail": "not found"}')
        if TOKEN and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            with LOCK:
                STATE["unauthorized"] += 1
            return self._reply(401, b'{"detail": "bad token"}')
        with LOCK:
            STATE["requests"] += 1
            mode = STATE["mode"]
        if mode == "500":
            return self._reply(500, b"internal error")
        if mode == "hang":
            time.sleep(60)
            return self._reply(200, b'{"results": []}')
        if mode == "garbage":
            return self._reply(200, b"<html>this is not json", "text/html")
        items = json.loads(body)["items"]
        results = [score_item(it) for it in items]
        with LOCK:
            STATE["items_scored"] += sum(1 for r in results if r.get("status", "ok") == "ok")
        self._reply(200, json.dumps({"results": results}).encode())


def main() -> int:
    global TOKEN
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token-env", default="", help="require this environment variable's value as bearer token")
    args = ap.parse_args()
    if args.token_env:
        TOKEN = os.environ[args.token_env]
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"listening on {args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
