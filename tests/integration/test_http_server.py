"""The bounded HTTP server (broker/runtime/httpserver.py) against clients that misbehave: a head too
slow, a head too large, a request with a body; a good request meanwhile is served."""

import socket
import threading
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from broker.runtime.httpserver import BoundedHTTPServer


class Hello(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b"hello\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server():
    s = BoundedHTTPServer(
        ("127.0.0.1", 0), Hello, workers=2, max_connections=4, head_timeout_s=1.0, max_head_bytes=1024
    )
    s.start()
    yield s
    s.shutdown()
    s.server_close()


def _reply(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(data)
        got = b""
        while part := c.recv(4096):
            got += part
        return got


def test_misbehaving_clients_are_answered_and_closed_and_counted(server):
    port = server.server_address[1]
    slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(6)]  # more than the cap
    for s in slow:
        s.sendall(b"GET / HTTP/1.1\r\n")  # never finished
    assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text == "hello\n"  # evicts the oldest, is served
    assert _reply(port, b"GET / HTTP/1.1\r\nX: " + b"a" * 2000 + b"\r\n\r\n").startswith(b"HTTP/1.0 431")
    assert _reply(port, b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello").startswith(b"HTTP/1.0 413")
    assert slow[-1].recv(100).startswith(b"HTTP/1.0 408")  # after the head deadline
    for s in slow:
        s.close()
    assert server.refused["evicted"] >= 3 and server.refused["head_timeout"] >= 1
    assert server.refused["head_too_large"] == 1 and server.refused["body"] == 1


def test_a_request_during_interpreter_exit_is_refused_without_a_traceback(server):
    """At interpreter exit Python shuts down every thread pool while a server's daemon thread still
    accepts (a scrape of a learner that has just finished): the request gets a 503, the thread stops
    quietly instead of dying with "cannot schedule new futures after shutdown"."""
    errors = []
    old, threading.excepthook = threading.excepthook, lambda args: errors.append(args.exc_value)
    try:
        server._pool.shutdown(wait=True)  # what concurrent.futures' exit hook leaves behind
        port = server.server_address[1]
        assert _reply(port, b"GET / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 503")
        server._thread.join(timeout=5)
        assert not server._thread.is_alive() and errors == []
        assert server.refused["shutting_down"] == 1
    finally:
        threading.excepthook = old
