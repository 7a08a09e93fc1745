"""What the generator's reward client makes of each answer of the reward service (docs/rewards.md,
"Failures"), against a real local HTTP server: a refused token or a URL that is not a reward service
is a configuration error that stops the generator; a service that is out is an outage (the batch is
held); a service that answers garbage fails the items for a reason of their own (sent, counted)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from broker.protocol.messages import ItemIn
from broker.runtime.config import ConfigError
from generators.config import GeneratorConfig
from generators.reward_client import RewardClient, RewardRefused
from generators.sink import outage

ITEMS = [
    ItemIn(prompt="12=", completion="12", reference="12", task="copy"),
    ItemIn(prompt="34=", completion="3", reference="34", task="copy"),
]


class Scorer(BaseHTTPRequestHandler):
    """Answers POST /score as ``Scorer.answer`` says: (status, body bytes); counts the requests."""

    answer: tuple[int, bytes] = (200, b"")
    requests = 0
    token = "right"

    def log_message(self, *a):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        Scorer.requests += 1
        status, body = Scorer.answer
        if self.path != "/score":
            status, body = 404, b'{"detail": "Not Found"}'
        elif self.headers.get("Authorization") != f"Bearer {Scorer.token}":
            status, body = 401, b'{"detail": "missing or wrong bearer token"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Scorer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    Scorer.requests, Scorer.answer = 0, (200, b"")
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _client(url: str, token: str = "right") -> RewardClient:
    return RewardClient(GeneratorConfig(reward_url=url, reward_token=token, reward_retries=1, reward_timeout_s=5))


def test_a_refused_token_stops_the_generator_with_the_setting_to_fix(server):
    for token, said in (
        ("wrong", "refused the generator's token (HTTP 401)"),
        ("", "refused the generator's token (HTTP 401, and the generator sent none)"),
    ):
        Scorer.requests = 0
        with pytest.raises(RewardRefused) as e:
            _client(server, token).score(ITEMS)
        assert said in str(e.value) and "set generator.reward_token to its reward.auth_token" in str(e.value)
        assert isinstance(e.value, ConfigError)  # relay generator exits 2 on it (deploy/cli.py)
        assert Scorer.requests == 1  # never retried: no retry can fix a token


def test_a_url_that_is_not_a_reward_service_stops_the_generator(server):
    with pytest.raises(
        RewardRefused,
        match=r"no reward service at .*: POST /score answered HTTP 404.*"
        r"set generator.reward.url",
    ):
        _client(server + "/api").score(ITEMS)


def test_garbage_fails_the_items_for_a_reason_of_their_own_not_an_outage(server):
    for answer, code in (
        ((200, b"<html>a proxy's page</html>"), "reward_malformed"),
        ((200, json.dumps({"results": [{"score": 1.0}]}).encode()), "reward_malformed"),
        ((413, b'{"detail": "too many items"}'), "reward_http_413"),
    ):
        Scorer.requests, Scorer.answer = 0, answer
        results = _client(server).score(ITEMS)
        assert [r.ok for r in results] == [False, False] and all(r.plugin == "reward_service" for r in results)
        assert all(r.reason.startswith(f"{code}: ") for r in results), results[0].reason
        assert outage([results]) is None  # sent as it is and counted, never held as an outage
        assert Scorer.requests == 2  # reward_retries = 1: a proxy's hiccup may pass


def test_a_service_that_is_out_is_an_outage(server):
    Scorer.answer = (503, b"busy")
    results = _client(server).score(ITEMS)
    assert all(r.reason.startswith("reward_service: ") for r in results)
    assert outage([results]) is not None  # the sink holds the batch and scores it again


def test_a_good_answer_is_the_results(server):
    results = [{"score": 1.0, "status": "ok"}, {"score": 0.5, "status": "ok"}]
    Scorer.answer = (200, json.dumps({"results": results}).encode())
    assert [r.score for r in _client(server).score(ITEMS)] == [1.0, 0.5]
