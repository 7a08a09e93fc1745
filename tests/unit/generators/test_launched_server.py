"""LaunchedServer (generators/backends/sglang_server.py) with a tiny real HTTP server standing in for SGLang:
a child that, like ``sglang.launch_server``, loads for a while, then binds its port (exiting with "Address
already in use" when the port is taken) and answers only requests that carry its key. The ports taken are
really taken, by a listening socket of this test or by another HTTP server answering 200 to anyone."""

from __future__ import annotations

import http.server
import os
import re
import socket
import sys
import threading

import httpx
import pytest

from broker.runtime.ports import free_port
from generators.backends.sglang_server import LaunchedServer, launch_sglang, listens, new_key

STANDIN = r"""
import http.server, sys, time
port, key, load_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
print("loading the model", flush=True)
print(f"server_args: api_key={key!r}", flush=True)  # as a server may print its arguments
time.sleep(load_s)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.headers.get("Authorization") == f"Bearer {key}"
        self.send_response(200 if ok else 401)
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


# stands in for SGLang's interpreter: `FAKE -m sglang.launch_server --config F --model-path M --host H --port P ...`
# reads the key from the config file as SGLang does (a YAML mapping) and serves with it
FAKE_PYTHON = r"""#!{python}
import json, os, stat, sys
argv = sys.argv[1:]
assert argv[:2] == ["-m", "sglang.launch_server"], argv
config = argv[argv.index("--config") + 1]
mode = stat.S_IMODE(os.stat(config).st_mode)
key = json.loads(open(config).read().split(":", 1)[1])
print(f"config mode {{mode:o}}, args {{argv[2:]}}", flush=True)
os.execv(sys.executable, [sys.executable, {standin!r}, argv[argv.index("--port") + 1], key, "0.2"])
"""


@pytest.fixture
def standin(tmp_path):
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    return lambda key, load_s=0.3: lambda port: [sys.executable, str(script), str(port), key, str(load_s)]


def ports_then(*first: int):
    """A port picker that hands out ``first``, then free ports."""
    queue = list(first)
    return lambda: queue.pop(0) if queue else free_port()


@pytest.fixture
def occupied():
    """A port with a listening socket on it (not accepting: a process that merely holds it)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@pytest.fixture
def impostor():
    """Another HTTP server on 127.0.0.1 that answers 200 to every GET, and records what it was sent."""
    seen = []

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(dict(self.headers))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1], seen
    srv.shutdown()
    srv.server_close()


def test_ready_once_it_answers_with_its_key_and_the_key_never_reaches_the_log(standin, capfd):
    key = new_key()
    srv = LaunchedServer(standin(key), {}, key, start_timeout_s=30)
    try:
        assert srv.ports == [srv.port] and listens(srv.pid, srv.port)
        assert httpx.get(f"{srv.url}/model_info", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(f"{srv.url}/model_info").status_code == 401
    finally:
        srv.stop()
    assert srv.proc.poll() is not None
    srv.output.thread.join(5)
    err = capfd.readouterr().err
    assert "loading the model" in err and "api_key='***'" in err and key not in err


def test_a_port_taken_before_the_server_binds_it_is_replaced_by_a_fresh_one(standin, occupied):
    key = new_key()
    srv = LaunchedServer(standin(key), {}, key, start_timeout_s=30, pick_port=ports_then(occupied))
    try:
        assert srv.ports[0] == occupied and srv.port != occupied and len(srv.ports) == 2
        assert "Address already in use" in srv.taken[occupied] and list(srv.taken) == [occupied]
        assert listens(srv.pid, srv.port) and not listens(srv.pid, occupied)
    finally:
        srv.stop()


def test_a_process_answering_on_the_port_is_never_taken_for_the_server_nor_sent_the_key(standin, impostor):
    port, seen = impostor
    key = new_key()
    srv = LaunchedServer(standin(key, load_s=1.5), {}, key, start_timeout_s=30, pick_port=ports_then(port))
    try:
        assert srv.ports == [port, srv.port] and srv.port != port
        assert seen == []  # not a request: not the probe, not the key
        assert httpx.get(f"http://127.0.0.1:{port}/x").status_code == 200  # it was answering all along
        assert len(seen) == 1 and "Authorization" not in seen[0]
    finally:
        srv.stop()


def test_when_every_port_is_taken_the_error_names_them_and_the_servers_last_output(standin, occupied):
    key = new_key()
    with pytest.raises(RuntimeError) as e:
        LaunchedServer(standin(key), {}, key, start_timeout_s=30, pick_port=lambda: occupied, tries=3)
    msg = str(e.value)
    assert f"each of {[occupied] * 3} was taken" in msg and "Address already in use" in msg and key not in msg


def test_a_server_that_exits_for_another_reason_is_not_started_again(tmp_path):
    starts = []

    def argv_for(port):
        starts.append(port)
        return [sys.executable, "-c", "import sys; print('no such model: /nowhere'); sys.exit(3)"]

    with pytest.raises(
        RuntimeError,
        match=r"exited with code 3 while starting on port \d+; its last output:\n"
        r"no such model: /nowhere",
    ):
        LaunchedServer(argv_for, {}, new_key(), start_timeout_s=30)
    assert len(starts) == 1


def test_launch_sglang_hands_the_key_in_a_private_file_removed_once_ready(tmp_path, standin, capfd):
    standin(new_key())  # writes the stand-in server
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable, standin=str(tmp_path / "standin.py")))
    fake.chmod(0o700)
    key = new_key()
    srv = launch_sglang(str(fake), "/models/m", ["--dtype", "float32"], {}, 30, key)
    try:
        assert httpx.get(f"{srv.url}/model_info", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(f"{srv.url}/model_info", headers={"Authorization": "Bearer x"}).status_code == 401
    finally:
        srv.stop()
    srv.output.thread.join(5)
    err = capfd.readouterr().err
    assert "config mode 600" in err and "'--model-path', '/models/m'" in err and "'--dtype', 'float32'" in err
    assert key not in err
    config = re.search(r"'--config', '([^']+)'", err).group(1)
    assert not os.path.exists(config)  # removed once the server was ready


def test_launch_args_may_not_carry_a_key_and_keys_are_fresh_and_parseable():
    for args in (["--api-key", "k"], ["--api-key=k"], ["--config", "x.yaml"]):
        with pytest.raises(ValueError, match="may not set --api-key or --config"):
            launch_sglang(sys.executable, "/m", args, {}, 1, "key")
    for bad in ("-key", "a key", "k\n"):
        with pytest.raises(ValueError, match="not start with '-'"):
            launch_sglang(sys.executable, "/m", [], {}, 1, bad)
    keys = {new_key() for _ in range(2000)}
    assert len(keys) == 2000 and all(len(k) >= 43 and not k.startswith("-") for k in keys)
    with pytest.raises(ValueError, match="always requires a key"):
        LaunchedServer(lambda port: ["true"], {}, "", 1)


def test_a_server_is_never_blocked_by_output_this_process_cannot_write(tmp_path, monkeypatch):
    """Past this process's closed stderr (a generator exiting), the server's output is still drained: a child
    that prints 1 MiB (16 pipe buffers) before it binds still becomes ready."""
    script = tmp_path / "chatty.py"
    script.write_text("import sys\nfor _ in range(16384): print('x' * 63)\nsys.stdout.flush()\n" + STANDIN)
    closed = open(tmp_path / "stderr", "w")
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    key = new_key()
    srv = LaunchedServer(lambda port: [sys.executable, str(script), str(port), key, "0"], {}, key, start_timeout_s=30)
    try:
        assert httpx.get(f"{srv.url}/model_info", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    finally:
        srv.stop()
