"""The OpenAI endpoint's request rules (generators/openai_server.py) on a fake engine: sampling that
differs from the run's is refused or overridden (said in X-Relay-Sampling), max_tokens is clamped,
streaming and n > 1 are refused, no weights yet is 503, and /v1/completions sessions follow the
token-in-token-out rule on text. The real model, chat template and broker: tests/integration/test_openai_endpoint.py."""

import threading
import types

import pytest
from fastapi.testclient import TestClient

from generators.backends.base import Completion
from generators.config import GeneratorConfig
from generators.openai_server import OpenAIEndpoint, create_app

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
        ids = [*map(ord, self.said), EOS][:sampling.max_tokens]
        return [[Completion(ids, [-0.1] * len(ids), "stop" if ids[-1] == EOS else "length")]]


def endpoint(version=0, **openai):
    cfg = GeneratorConfig(sampling={"temperature": 0.7, "max_tokens": 16},
                          openai={"enabled": True, "group_size": 2, **openai})
    gen = types.SimpleNamespace(cfg=cfg, backend=FakeBackend(), tokens=0, stop=threading.Event(),
                                weights=types.SimpleNamespace(version=version, hash="h", receiver=None))
    ep = OpenAIEndpoint(gen, threading.RLock())
    return ep, gen.backend, TestClient(create_app(ep))


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
    assert be.calls[-1][0][:len(be.calls[-2][0])] == be.calls[-2][0]  # what was held stays as it was
    s = ep.sessions.by_id["s"]
    assert sum(s.trainable) == 9 and s.tokens[:2] == [ord("Q"), ord(":")]
    # no session: answered, not recorded
    c.post("/v1/completions", json={"prompt": "x"})
    assert ep.untracked == 1 and list(ep.sessions.by_id) == ["s"]


def test_a_wrong_or_missing_key_is_refused():
    _, _, c = endpoint(api_key="k")
    assert c.get("/v1/models").status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "relay"


@pytest.mark.parametrize("body", [{}, {"reward": "1"}, {"reward": float("nan")}, {"reward": True}])
def test_a_reward_must_be_a_finite_number(body):
    ep, _, c = endpoint()
    c.post("/v1/completions", json={"prompt": "Q:"}, headers={"X-Relay-Session": "s"})
    r = c.post("/v1/relay/sessions/s/reward", content=__import__("json").dumps(body, allow_nan=True))
    assert r.status_code == 400 and ep.sessions.by_id["s"].reward is None
