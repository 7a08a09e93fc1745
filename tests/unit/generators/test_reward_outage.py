"""Which failed batches are a reward *outage* (held and scored again, generators/sink.py) and which are
the items' own failures (sent failed, dropped or given the fallback score by the learner)."""

from broker.protocol.messages import ResultOut
from generators.sink import outage


def _failed(reason: str) -> ResultOut:
    return ResultOut.failed(reason, "scorer")


def test_every_item_failed_for_an_outage_is_an_outage():
    for reason in (
        "reward_service: ConnectError: refused",
        "remote_http_500: boom",
        "remote_http_503: busy",
        "remote_http_429: slow down",
        "remote_timeout: no reply within 1.0s",
        "remote_unreachable: ConnectError",
        "remote_circuit_open: 5 consecutive failures",
    ):
        assert outage([[_failed(reason)] * 3, [_failed(reason)]]) == reason, reason
    mixed = [[_failed("remote_http_500: a"), _failed("remote_circuit_open: b")]]
    assert outage(mixed) == "remote_http_500: a"


def test_a_scored_item_or_an_items_own_failure_is_not_an_outage():
    ok = ResultOut(score=1.0, status="ok", plugin="scorer")
    assert outage([[_failed("remote_http_500: x"), ok]]) is None  # the scorer answered for someone
    for reason in (
        "remote_malformed: not JSON",
        "remote_http_401: wrong token",
        "remote_http_404: no route",
        "remote_failed: no_reference",
        "env_error: crashed",
        "empty_completion: nothing to score",
        "remote_http_5000: not a status",
    ):
        assert outage([[_failed(reason)] * 2]) is None, reason
    assert outage([]) is None and outage([[]]) is None
