"""The OpenAI endpoint's request rules (generators/openai_endpoint.py, served by openai_server.py) on a fake
engine: sampling that differs from the run's is refused or overridden (said in X-Relay-Sampling), max_tokens is clamped,
streaming and n > 1 are refused, no weights yet is 503, and /v1/completions sessions follow the
token-in-token-out rule on text; no key, or a body that is not JSON, is refused before anything is read or
sampled; a response names its weight version, its prompt's tokens and, when asked, its behaviour log-probs;
a caller's reward is marked as such. The real model, chat template and broker:
tests/integration/test_openai_endpoint.py; `relay up`'s key and a local attacker:
tests/integration/test_openai_endpoint_access.py."""

import threading
import types

import pytest
from fastapi.testclient import TestClient

from generators.backends.base import Completion
from generators.config import GeneratorConfig
from generators.openai_endpoint import EndpointContext, OpenAIEndpoint
from generators.openai_server import create_app

EOS = 0


class FakeBackend:
    """Characters as tokens; every call "samples" ``said`` + EOS and records its sampling."""

    name, eos_token_id = "fake", EOS

    def __init__(self, said="ok"):
        self.said, self.calls = said, []

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != EOS)

    def generate(self, prompts, sampling, seed, on_step=None):
        self.calls.append((prompts[0], sampling))
        ids = [*map(ord, self.said), EOS][: sampling.max_tokens]
        return [[Completion(ids, [-0.1] * len(ids), "stop" if ids[-1] == EOS else "length")]]


def endpoint(version=0, **openai):
    """An endpoint on the fake engine: open (no key) unless ``api_key`` is given."""
    cfg = GeneratorConfig(
        sampling={"temperature": 0.7, "max_tokens": 16},
        openai={"enabled": True, "group_size": 2, **({} if "api_key" in openai else {"open": True}), **openai},
    )
    backend = FakeBackend()
    ctx = EndpointContext(
        cfg=cfg.openai,
        sampling=cfg.sampling,
        seed=cfg.seed,
        generator_id=cfg.id,
        run_id=cfg.run_id,
        backend=backend,
        engine_lock=threading.RLock(),
        served=lambda: (version, "h"),
        hash_for=None,
        count_tokens=lambda n: None,
        send_group=None,
        score=None,
        stop=threading.Event(),
        emit=lambda *a, **kw: None,
    )
    ep = OpenAIEndpoint(ctx)
    return ep, backend, TestClient(create_app(ep))


def test_sampling_other_than_the_runs_is_refused_or_overridden_and_said():
    ep, be, c = endpoint()
    r = c.post("/v1/completions", json={"prompt": "hi", "temperature": 1.0})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"] and not be.calls
    r = c.post("/v1/completions", json={"prompt": "hi", "temperature": 0.7, "max_tokens": 999})
    assert r.status_code == 200 and r.headers["x-relay-sampling"] == "as-run"
    assert be.calls[-1][1].temperature == 0.7 and be.calls[-1][1].max_tokens == 16  # clamped to the run's
    ep, be, c = endpoint(sampling_mismatch="override", max_tokens=2)
    r = c.post("/v1/completions", json={"prompt": "hi", "temperature": 1.0, "top_p": 0.5})
    assert r.status_code == 200 and r.headers["x-relay-sampling"] == "overridden: temperature=0.7, top_p=1.0"
    assert be.calls[-1][1].temperature == 0.7 and be.calls[-1][1].max_tokens == 2
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_streaming_n_and_missing_weights_are_refused_clearly():
    _, be, c = endpoint()
    assert c.post("/v1/completions", json={"prompt": "hi", "stream": True}).status_code == 400
    assert c.post("/v1/completions", json={"prompt": "hi", "n": 2}).status_code == 400
    assert c.post("/v1/completions", json={"prompt": "hi", "temperature": "hot"}).status_code == 400
    _, be, c = endpoint(version=None)
    r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and "weights" in r.json()["error"]["message"]


def test_completions_sessions_keep_their_tokens_and_count_drift():
    ep, be, c = endpoint()
    h = {"X-Relay-Session": "s", "X-Relay-Group": "g"}
    r1 = c.post("/v1/completions", json={"prompt": "Q:"}, headers=h).json()
    assert r1["choices"][0]["text"] == "ok" and r1["relay"]["completion_ids"] == [ord("o"), ord("k"), EOS]
    # the harness continues the text it got: the model is fed the session's tokens (EOS included) + the new text
    r2 = c.post("/v1/completions", json={"prompt": "Q:ok A:"}, headers=h).json()
    assert be.calls[-1][0] == [*map(ord, "Q:ok"), EOS, *map(ord, " A:")] and r2["relay"]["template_drift"] == 0
    r3 = c.post("/v1/completions", json={"prompt": "Q:changed"}, headers=h).json()  # rewrote its history
    assert r3["relay"]["template_drift"] == 1
    assert be.calls[-1][0][: len(be.calls[-2][0])] == be.calls[-2][0]  # what was held stays as it was
    s = ep.sessions.by_id["s"]
    assert sum(s.trainable) == 9 and s.tokens[:2] == [ord("Q"), ord(":")]
    # no session: answered, not recorded
    c.post("/v1/completions", json={"prompt": "x"})
    assert ep.counters.untracked == 1 and list(ep.sessions.by_id) == ["s"]


def test_a_wrong_or_missing_key_is_refused():
    _, _, c = endpoint(api_key="k")
    assert c.get("/v1/models").status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "relay"


@pytest.mark.parametrize("body", [{}, {"reward": "1"}, {"reward": float("nan")}, {"reward": True}])
def test_a_reward_must_be_a_finite_number(body):
    ep, _, c = endpoint()
    c.post("/v1/completions", json={"prompt": "Q:"}, headers={"X-Relay-Session": "s"})
    r = c.post(
        "/v1/relay/sessions/s/reward",
        content=__import__("json").dumps(body, allow_nan=True),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and ep.sessions.by_id["s"].reward is None


# -- access: a key unless opened on loopback, JSON only, no CORS (issue 44) ----------------------------------


def test_an_enabled_endpoint_needs_a_key_or_to_be_opened_on_a_loopback_host():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="RELAY_OPENAI__API_KEY.*openai.open = true"):
        GeneratorConfig(openai={"enabled": True})
    with pytest.raises(ValidationError, match="only on a loopback host"):
        GeneratorConfig(openai={"enabled": True, "open": True, "host": "0.0.0.0"})
    with pytest.raises(ValidationError, match="both given"):
        GeneratorConfig(openai={"enabled": True, "open": True, "api_key": "k"})
    assert GeneratorConfig(openai={"enabled": True, "api_key": "k", "host": "0.0.0.0"}).openai.api_key == "k"
    assert GeneratorConfig(openai={"enabled": True, "open": True}).openai.open
    assert not GeneratorConfig().openai.enabled  # off by default: nothing to authenticate


def test_without_the_key_nothing_is_answered_sampled_or_rewarded():
    ep, be, c = endpoint(api_key="k")
    ok = {"Authorization": "Bearer k"}
    assert c.post("/v1/completions", json={"prompt": "Q:"}, headers={**ok, "X-Relay-Session": "s"}).status_code == 200
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer nope"}, {"Authorization": "k"}):
        assert (
            c.post("/v1/completions", json={"prompt": "Q:"}, headers={**headers, "X-Relay-Session": "t"}).status_code
            == 401
        )
        assert c.post("/v1/relay/sessions/s/reward", json={"reward": 1.0}, headers=headers).status_code == 401
        assert c.get("/v1/relay/sessions/s", headers=headers).status_code == 401
    assert len(be.calls) == 1 and list(ep.sessions.by_id) == ["s"] and ep.sessions.by_id["s"].reward is None
    assert (
        ep.counters.requests[("completions", "unauthorized")] == 4
        and ep.counters.requests[("reward", "unauthorized")] == 4
    )


@pytest.mark.parametrize("api_key", ["", "k"])
def test_a_post_that_is_not_json_is_refused_415_before_it_is_read(api_key):
    """What a web page on another site can send without a preflight (text/plain, a form) is refused, with or
    without a key (an open endpoint has nothing else between it and a page the operator opens)."""
    ep, be, c = endpoint(**({"api_key": api_key} if api_key else {}))
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    assert c.post("/v1/completions", json={"prompt": "Q:"}, headers={**auth, "X-Relay-Session": "s"}).status_code == 200
    page = {**auth, "Origin": "http://evil.example", "X-Relay-Session": "s"}
    for ctype in (
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "",
    ):
        headers = {**page, **({"Content-Type": ctype} if ctype else {})}
        for path, body in (
            ("/v1/completions", '{"prompt": "Q:"}'),
            ("/v1/chat/completions", '{"messages": []}'),
            ("/v1/relay/sessions/s/reward", '{"reward": 1.0}'),
        ):
            r = c.post(path, content=body, headers=headers)
            assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], (path, ctype, r.text)
            assert "access-control-allow-origin" not in r.headers
    assert len(be.calls) == 1 and ep.sessions.by_id["s"].reward is None and ep.sessions.by_id["s"].calls == 1
    # no CORS: a preflight for a JSON POST gets no allowance, so a browser never sends it
    pre = c.options(
        "/v1/completions",
        headers={
            "Origin": "http://evil.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization",
        },
    )
    assert pre.status_code >= 400 and not any(h.startswith("access-control-") for h in pre.headers)
    # JSON with a charset is JSON
    r = c.post(
        "/v1/relay/sessions/s/reward",
        content='{"reward": 0.5}',
        headers={**auth, "Content-Type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200 and ep.sessions.by_id["s"].reward == 0.5


# -- what a response says: weight version, usage, logprobs; rewards' provenance (issue 43, 44) -------------


def test_a_response_names_its_weight_version_and_counts_its_prompt_tokens_without_a_session():
    _, _, c = endpoint(version=7)
    r = c.post("/v1/completions", json={"prompt": "Hello"})
    assert r.headers["x-relay-weight-version"] == "7" and r.json()["relay"]["weight_version"] == 7
    assert r.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    h = {"X-Relay-Session": "s"}
    c.post("/v1/completions", json={"prompt": "Q:"}, headers=h)
    r = c.post("/v1/completions", json={"prompt": "Q:ok A:"}, headers=h).json()
    assert r["usage"] == {"prompt_tokens": 2 + 3 + 3, "completion_tokens": 3, "total_tokens": 11}  # Q: ok<eos> A:


def test_logprobs_are_the_behaviour_logprobs_of_the_sampled_tokens_and_alternatives_are_refused():
    _, be, c = endpoint()
    r = c.post("/v1/completions", json={"prompt": "Hi", "logprobs": 0}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == ["o", "k", ""] and lp["token_logprobs"] == pytest.approx([-0.1] * 3)
    assert lp["text_offset"] == [2, 3, 4] and r["relay"]["completion_ids"] == [ord("o"), ord("k"), EOS]
    assert c.post("/v1/completions", json={"prompt": "Hi"}).json()["choices"][0]["logprobs"] is None
    n = len(be.calls)
    for body, what in (
        ({"logprobs": 3}, "not available"),
        ({"logprobs": True}, "integer"),
        ({"logprobs": -1}, "integer"),
    ):
        r = c.post("/v1/completions", json={"prompt": "Hi", **body})
        assert r.status_code == 400 and what in r.json()["error"]["message"]
    assert len(be.calls) == n  # refused before sampling


def test_chat_on_a_model_without_a_chat_template_is_a_400_that_says_so():
    ep, be, c = endpoint()
    be.tokenizer = types.SimpleNamespace(chat_template=None)
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    assert "/v1/completions" in r.json()["error"]["message"] and not be.calls
    r = c.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2, "logprobs": True},
    )
    assert r.status_code == 400 and "top_logprobs = 2 is not available" in r.json()["error"]["message"]


def test_a_callers_reward_is_marked_caller_and_can_be_refused_for_the_reward_services():
    ep, _, c = endpoint()
    for sid in ("a", "b"):
        c.post("/v1/completions", json={"prompt": "Q:"}, headers={"X-Relay-Session": sid, "X-Relay-Group": "g"})
    assert c.post("/v1/relay/sessions/a/reward", json={"reward": 0.5}).json() == {
        "session": "a",
        "group_complete": False,
    }
    assert ep.sessions.by_id["a"].reward_details == {"source": "caller"} and ep.counters.rewarded["caller"] == 1

    # the reward service's score: its plugin's sub-scores kept, where it came from not overridable by them
    ep, _, c = endpoint(reward_source="reward_service")
    ep.ctx.score = lambda items: [
        types.SimpleNamespace(
            ok=True, score=1.0, plugin="digits", reason="", details={"source": "forged", "exact": 1.0}
        )
    ]
    c.post("/v1/completions", json={"prompt": "Q:"}, headers={"X-Relay-Session": "a", "X-Relay-Group": "g"})
    r = c.post("/v1/relay/sessions/a/reward", json={"reward": 1.0})
    assert r.status_code == 403 and "reward_source" in r.json()["error"]["message"]
    assert ep.sessions.by_id["a"].reward is None
    assert c.post("/v1/relay/sessions/a/reward", json={"task": "digits", "reference": "ok"}).status_code == 200
    assert ep.sessions.by_id["a"].reward_details == {"source": "reward_service:digits", "exact": 1.0}
    assert ep.counters.rewarded == {"caller": 0, "reward_service": 1}


def test_a_call_samples_under_the_engine_lock():
    """The generator's loop, evaluation and weight updates take turns with the endpoint's calls."""
    ep, be, c = endpoint()
    held = []
    inner = be.generate

    def generate(*a, **kw):
        t = threading.Thread(target=lambda: held.append(not ep.ctx.engine_lock.acquire(blocking=False)))
        t.start()
        t.join()
        return inner(*a, **kw)

    be.generate = generate
    assert c.post("/v1/completions", json={"prompt": "Q:"}).status_code == 200
    assert held == [True]
