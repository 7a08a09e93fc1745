"""The reward service as a real process calling real HTTP servers: a remote reward server
(tests/support/remote_reward_server.py) and an OpenAI-compatible judge; its own guards (bearer token,
request size)."""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from deploy.launcher.procs import free_port
from tests.support.services import ROOT, child_env, wait_http
from tests.support.services import metric_value

ITEMS = [
    {"prompt": "12=", "completion": "12", "reference": "12", "task": "copy"},
    {"prompt": "12=", "completion": "19", "reference": "12", "task": "copy"},
]


def _remote(procs, token: str = ""):
    port = free_port()
    args = [sys.executable, str(ROOT / "tests" / "support" / "remote_reward_server.py"), "--port", str(port)]
    env = child_env()
    if token:
        args += ["--token-env", "REMOTE_TOKEN"]
        env["REMOTE_TOKEN"] = token
    child = procs.start("remote", args, env=env)
    wait_http(f"http://127.0.0.1:{port}/stats", child)
    return f"http://127.0.0.1:{port}"


def _service(procs, tmp_path, cfg: dict, env: dict | None = None) -> str:
    port = free_port()
    path = tmp_path / "reward.json"
    path.write_text(json.dumps({"port": port, **cfg}))
    child = procs.start(
        "reward",
        [sys.executable, "-m", "deploy.cli", "reward", "--config", str(path)],
        env={**child_env(), **(env or {})},
        cwd=str(ROOT),
    )
    wait_http(f"http://127.0.0.1:{port}/healthz", child)
    return f"http://127.0.0.1:{port}"


def test_remote_plugin_failures_are_failed_items_with_reasons_and_the_breaker_opens(procs, tmp_path):
    """Every way a remote server fails is a failed item with its reason; only the failures that say the
    server is out (5xx, timeouts) count toward the circuit breaker: a 401 (a wrong token) or garbage came
    from a server that answered, and never open it (so they are never taken for an outage)."""
    remote = _remote(procs, token="tok")
    opts = {
        "url": f"{remote}/score",
        "token_env": "REMOTE_TOKEN",
        "timeout_s": 0.5,
        "retries": 1,
        "backoff_s": 0.01,
        "breaker_failures": 4,
        "breaker_reset_s": 1.0,
    }
    base = _service(
        procs,
        tmp_path,
        {
            "plugins": {
                "rm": {"type": "remote", "options": opts},
                "rm_notoken": {"type": "remote", "options": {"url": f"{remote}/score", "retries": 3}},
            },
            "task_plugins": {"copy": "rm", "nt": "rm_notoken"},
        },
        env={"REMOTE_TOKEN": "tok"},
    )

    def score(task="copy"):
        return httpx.post(f"{base}/score", json={"items": [dict(it, task=task) for it in ITEMS]}, timeout=30).json()[
            "results"
        ]

    ok = score()
    assert [r["score"] for r in ok] == [1.0, 0.5] and ok[1]["details"] == {"prefix": 1.0}
    assert ok[0]["plugin"] == "rm"
    for _ in range(6):  # more 401s than breaker_failures (5 by default): never the breaker, always the reason
        unauthorized = score("nt")  # a 401 is not retried
        assert all(r["status"] == "failed" and r["reason"].startswith("remote_http_401") for r in unauthorized)
    assert httpx.get(f"{remote}/stats").json()["unauthorized"] == 6
    for _ in range(5):  # garbage, more often than breaker_failures: the items fail, the breaker stays shut
        httpx.post(f"{remote}/control", json={"mode": "garbage"})
        assert score()[0]["reason"].startswith("remote_malformed")
    for mode, reason in (("500", "remote_http_500"), ("garbage", "remote_malformed"), ("hang", "remote_timeout")):
        httpx.post(f"{remote}/control", json={"mode": mode})
        t0 = time.monotonic()
        res = score()
        assert [r["status"] for r in res] == ["failed", "failed"] and all(r["score"] is None for r in res)
        assert res[0]["reason"].startswith(reason), res
        if mode == "hang":
            assert time.monotonic() - t0 < 5  # two attempts of 0.5 s, not the server's 60 s
    # 500 (2 attempts), garbage (an answer: the count starts over), hang (2 attempts): 2 consecutive failures
    res = score()
    assert res[0]["reason"].startswith("remote_timeout"), res  # the breaker (4) is still shut
    # the third and fourth consecutive failures opened it
    res = score()
    assert res[0]["reason"].startswith("remote_circuit_open"), res
    httpx.post(f"{remote}/control", json={"mode": "ok"})
    time.sleep(1.1)  # breaker_reset_s: one trial request closes it again
    assert [r["score"] for r in score()] == [1.0, 0.5]
    m = httpx.get(f"{base}/metrics").text
    for reason in ("remote_http_500", "remote_malformed", "remote_timeout", "remote_circuit_open"):
        assert metric_value(m, "relay_reward_items_total", plugin="rm", status="failed", reason=reason) >= 2, reason
    assert metric_value(m, "relay_reward_items_total", plugin="rm_notoken", reason="remote_http_401") == 12
    assert metric_value(m, "relay_reward_items_total", plugin="rm_notoken", reason="remote_circuit_open") == 0
    assert metric_value(m, "relay_reward_remote_requests_total", plugin="rm", outcome="http_500") == 2
    assert metric_value(m, "relay_reward_circuit_open", plugin="rm") == 0.0
    assert metric_value(m, "relay_reward_batch_seconds_count", plugin="rm") >= 6


class Judge(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat-completions endpoint that grades by a rule."""

    requests: list = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Judge.requests.append((self.path, self.headers.get("Authorization"), body))
        user = body["messages"][-1]["content"]
        text = "Score: 10" if "Response:\nParis" in user else ("I refuse" if "Response:\n???" in user else "Score: 3")
        out = json.dumps(
            {
                "id": "x",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def test_judge_through_an_openai_compatible_endpoint(procs, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = f"http://127.0.0.1:{server.server_address[1]}/v1"
        base = _service(
            procs,
            tmp_path,
            {
                "plugins": {
                    "j": {"type": "judge", "options": {"base_url": api, "model": "grader-1", "token_env": "JUDGE_KEY"}}
                },
                "task_plugins": {"qa": "j"},
            },
            env={"JUDGE_KEY": "sk-test"},
        )
        items = [
            {"prompt": "Capital of France?", "completion": c, "reference": "Paris", "task": "qa"}
            for c in ("Paris", "Lyon", "???")
        ]
        res = httpx.post(f"{base}/score", json={"items": items}, timeout=30).json()["results"]
        assert [r["score"] for r in res] == [1.0, 0.3, None]
        assert res[2]["reason"].startswith("judge_unparsable")
        path, auth, body = Judge.requests[0]
        assert path == "/v1/chat/completions" and auth == "Bearer sk-test" and body["model"] == "grader-1"
    finally:
        server.shutdown()


def test_bearer_token_and_request_size_limit(procs, tmp_path):
    base = _service(procs, tmp_path, {"auth_token": "letmein", "max_request_bytes": 4096, "max_batch": 3})
    body = {"items": ITEMS}
    assert httpx.post(f"{base}/score", json=body).status_code == 401
    assert httpx.post(f"{base}/score", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    auth = {"Authorization": "Bearer letmein"}
    assert httpx.post(f"{base}/score", json=body, headers=auth).json()["results"][0]["score"] == 1.0
    big = {"items": [dict(ITEMS[0], completion="1" * 5000)]}
    r = httpx.post(f"{base}/score", json=big, headers=auth)
    assert r.status_code == 413 and "max_request_bytes" in r.text

    def chunks():  # no Content-Length: counted while streaming
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(f"{base}/score", content=chunks(), headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert httpx.post(f"{base}/score", json={"items": ITEMS * 2}, headers=auth).status_code == 413  # max_batch
    assert httpx.get(f"{base}/healthz").status_code == 200  # only /score is guarded


def _head(sock) -> bytes:
    """What the server answered, up to the end of its head (or what came before it closed)."""
    got = b""
    while b"\r\n\r\n" not in got:
        part = sock.recv(4096)
        if not part:
            break
        got += part
    return got


def test_an_unauthenticated_31_mib_body_is_refused_from_its_headers_without_being_read(procs, tmp_path):
    import socket

    base = _service(procs, tmp_path, {"auth_token": "letmein"})  # max_request_bytes: the default 32 MiB
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        # an attacker without the token announces 31 MiB and sends 1 KiB of it: the reply must not wait for more
        s.sendall(
            b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (31 * 2**20) + b"{" * 1024
        )
        t0 = time.monotonic()
        head = _head(s)
    assert head.startswith(b"HTTP/1.1 401") and time.monotonic() - t0 < 5, head
    auth = {"Authorization": "Bearer letmein"}
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # with the token, over the limit: 413
        s.sendall(
            b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer letmein\r\n"
            b"Content-Length: %d\r\n\r\n" % (33 * 2**20)
        )
        assert _head(s).startswith(b"HTTP/1.1 413")
    assert httpx.post(f"{base}/score", json={"items": ITEMS}, headers=auth).json()["results"][0]["score"] == 1.0


def test_a_client_that_goes_away_has_its_scoring_cancelled(procs, tmp_path):
    remote = _remote(procs)
    httpx.post(f"{remote}/control", json={"mode": "hang"})  # the remote takes 60 s to answer
    base = _service(
        procs,
        tmp_path,
        {
            "plugins": {"rm": {"type": "remote", "options": {"url": f"{remote}/score", "timeout_s": 30, "retries": 1}}},
            "task_plugins": {"copy": "rm"},
        },
    )
    try:
        httpx.post(f"{base}/score", json={"items": ITEMS}, timeout=1.0)
        raise AssertionError("the remote hangs: the request cannot be answered within 1 s")
    except httpx.TimeoutException:
        pass  # the client gave up and closed its connection
    deadline = time.monotonic() + 10
    while metric_value(httpx.get(f"{base}/metrics").text, "relay_reward_abandoned_requests_total") != 1:
        assert time.monotonic() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.1)
    m = httpx.get(f"{base}/metrics").text
    # cancelled, not scored: no item of it was counted (as a timeout 30 s later, or at all)
    assert metric_value(m, "relay_reward_items_total", plugin="rm", status="failed", reason="remote_timeout") == 0
    httpx.post(f"{remote}/control", json={"mode": "ok"})
    assert httpx.post(f"{base}/score", json={"items": ITEMS}, timeout=30).json()["results"][0]["score"] == 1.0
