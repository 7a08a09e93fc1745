"""LaunchedServer (generators/backends/sglang_server.py) with a tiny real HTTP server standing in for SGLang:
a child that, like ``sglang.launch_server``, loads for a while, then binds its port and answers only requests
that carry its key."""

from __future__ import annotations

import os
import re
import sys

import httpx
import pytest

from generators.backends.sglang_server import LaunchedServer, launch_sglang, new_key

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


def test_ready_once_it_answers_with_its_key_and_the_key_never_reaches_the_log(standin, capfd):
    key = new_key()
    srv = LaunchedServer(standin(key), {}, key, start_timeout_s=30)
    try:
        assert httpx.get(f"{srv.url}/model_info", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(f"{srv.url}/model_info").status_code == 401
    finally:
        srv.stop()
    assert srv.proc.poll() is not None
    srv.output.thread.join(5)
    err = capfd.readouterr().err
    assert "loading the model" in err and "api_key='***'" in err and key not in err


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
