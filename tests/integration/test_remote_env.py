"""The ``remote`` environment against a real environment server written in Node from docs/agents.md
(tests/support/remote_env_server.js), run as its own process on a free port: episodes run, and a
server that hangs, fails or answers garbage leaves the failures counted by reason while the client
stays usable."""

import shutil
import time

import httpx
import pytest

from broker.protocol.messages import PromptEntry
from deploy.launcher.procs import free_port
from generators.envs.base import EnvError
from generators.envs.registry import build_env
from tests.support.services import ROOT, child_env, wait_http

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(
    NODE is None,
    reason="node is not installed (`make nodejs` installs it as root): "
    "this test's remote environment server is written in Node",
)

P = PromptEntry("7*8=", reference="56", task="calc")


def _server(procs, token: str = "") -> str:
    port = free_port()
    argv = [NODE, str(ROOT / "tests" / "support" / "remote_env_server.js"), "--port", str(port)]
    env = child_env()
    if token:
        argv += ["--token-env", "ENV_TOKEN"]
        env["ENV_TOKEN"] = token
    child = procs.start("remote-env", argv, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/stats", child)
    return url


def _mode(url: str, mode: str) -> None:
    httpx.post(f"{url}/control", json={"mode": mode}).raise_for_status()


def _episode(factory) -> float:
    env = factory()
    env.reset(P)
    r1 = env.step("<tool_call>7*8</tool_call>")
    assert (r1.reply, r1.role, r1.done, r1.reward) == ("56", "tool", False, None)
    assert [(c.name, c.ok) for c in r1.tool_calls] == [("calculator", True)]
    r2 = env.step("56")
    assert r2.done and r2.reply is None
    env.close()
    return r2.reward


def _failing_step(factory, url: str, mode: str) -> EnvError:
    env = factory()
    env.reset(P)
    _mode(url, mode)
    try:
        with pytest.raises(EnvError) as e:
            env.step("<tool_call>7*8</tool_call>")
        env.close()  # as the generator does after a failure: it fails too, counted as close_failed
    finally:
        _mode(url, "ok")
    return e.value


def test_episodes_and_failures_by_reason(procs, monkeypatch):
    url = _server(procs, token="s3cret")
    monkeypatch.setenv("ENV_TOKEN", "s3cret")
    factory = build_env(
        "remote",
        {
            "url": url,
            "token_env": "ENV_TOKEN",
            "timeout_s": 0.5,
            "retries": 1,
            "backoff_s": 0.01,
            "breaker_failures": 100,
        },
    )
    try:
        assert _episode(factory) == 1.0
        stats = httpx.get(f"{url}/stats").json()
        assert (stats["resets"], stats["steps"], stats["closes"], stats["open_episodes"]) == (1, 2, 1, 0)

        t0 = time.monotonic()
        assert _failing_step(factory, url, "hang").reason == "timeout"
        assert time.monotonic() - t0 < 5  # attempts of 0.5 s, not a hung generator
        assert _failing_step(factory, url, "500").reason == "http_500"
        assert _failing_step(factory, url, "garbage").reason == "bad_reply"

        assert _episode(factory) == 1.0  # the same client goes on once the server is fine
        s = factory.stats()
        assert s["errors"] == {"timeout": 1, "http_500": 1, "bad_reply": 1, "close_failed": 3}
        assert s["requests"]["timeout"] == 4 and s["requests"]["http_500"] == 4 and s["requests"]["malformed"] == 2
        assert s["circuit"] == "closed" and s["episodes"] == 5
    finally:
        factory.close()

    wrong = build_env("remote", {"url": url, "retries": 3})  # no token: a 401 is not retried
    try:
        with pytest.raises(EnvError) as e:
            wrong().reset(P)
        assert e.value.reason == "http_401" and httpx.get(f"{url}/stats").json()["unauthorized"] == 1
    finally:
        wrong.close()


def test_circuit_opens_after_repeated_failures_and_recovers(procs):
    url = _server(procs)
    factory = build_env(
        "remote", {"url": url, "timeout_s": 2, "retries": 0, "breaker_failures": 3, "breaker_reset_s": 1.0}
    )
    try:
        _mode(url, "500")
        reasons = []
        for _ in range(5):
            with pytest.raises(EnvError) as e:
                factory().reset(P)
            reasons.append(e.value.reason)
        assert reasons == ["http_500"] * 3 + ["circuit_open"] * 2
        assert httpx.get(f"{url}/stats").json()["requests"] == 3  # an open circuit leaves the server alone
        assert factory.stats()["circuit"] == "open"

        _mode(url, "ok")
        time.sleep(1.1)  # breaker_reset_s: one trial request, which succeeds, closes it
        assert _episode(factory) == 1.0
        s = factory.stats()
        assert s["circuit"] == "closed" and s["errors"] == {"http_500": 3, "circuit_open": 2}
    finally:
        factory.close()


def test_closing_the_factory_ends_calls_in_flight(procs):
    import threading

    url = _server(procs)
    factory = build_env("remote", {"url": url, "timeout_s": 60, "retries": 0})
    env = factory()
    env.reset(P)
    _mode(url, "hang")
    seen = []

    def step():
        try:
            env.step("56")
        except EnvError as e:
            seen.append(e.reason)

    t = threading.Thread(target=step)
    t.start()
    time.sleep(0.5)
    factory.close()  # the generator stops: the episode waiting on a hung server ends now, not in 60 s
    t.join(timeout=5)
    assert not t.is_alive() and seen == ["closed"]
    with pytest.raises(EnvError) as e:
        factory().reset(P)
    assert e.value.reason == "closed"


def test_the_node_server_of_docs_agents_md_runs_episodes(procs, tmp_path):
    import re

    doc = (ROOT / "docs" / "agents.md").read_text()
    src = re.search(r"```js\n(.*?)```", doc, re.DOTALL).group(1)
    port = free_port()
    assert ".listen(9100," in src
    (tmp_path / "server.js").write_text(src.replace(".listen(9100,", f".listen({port},"))
    child = procs.start("doc-env", [NODE, str(tmp_path / "server.js")], env=child_env())
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):  # it has no health endpoint: wait until it accepts connections
        try:
            httpx.post(f"{url}/close", json={"episode_id": "none"})
            break
        except httpx.TransportError:
            assert child.alive(), child.tail(20)
            time.sleep(0.1)
    factory = build_env("remote", {"url": url})
    try:
        assert _episode(factory) == 1.0
        assert factory.stats()["requests"] == {"ok": 4}
    finally:
        factory.close()
