"""The broker's HTTP side against bad records and bad clients, as a real process on a real Redis: a
malformed heartbeat, evaluation round, evaluation result or stats field is skipped and counted, never a
broken page or /metrics; connections that never finish their request (a slowloris) do not keep
/healthz from answering."""

import json
import socket
import time

import httpx
import redis

from broker.client import queues
from broker.protocol.keys import Keys
from broker.protocol.messages import EvalCompletion, EvalResult, EvalRound, encode_eval_result
from tests.support.services import metric_value, start_broker


def _strict(text: str):
    """JSON as a browser parses it: NaN and Infinity are errors."""

    def refuse(constant):
        raise ValueError(f"bare {constant}: not JSON")

    return json.loads(text, parse_constant=refuse)


def test_malformed_records_are_skipped_and_counted_and_state_and_metrics_keep_working(procs, redis_url, tmp_path):
    _, http = start_broker(procs, redis_url, tmp_path)
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    r.hset(keys.eval_rounds, "0", EvalRound(version=0, prompts=1, greedy=True).encode())
    r.hset(keys.eval_rounds, "7", '{"version": "seven", "prompts": 2}')  # a wrong type
    good = EvalResult(version=0, generator="gen-0", greedy=EvalCompletion(reward=1.0, length=3))
    queues.add_eval_result(r, keys, 0, 0, encode_eval_result(good))
    for data in (
        b"\xff\xfe garbage",
        '{"version": 0, "greedy": {"reward": "high"}}',
        '{"greedy": [1, 2]}',
        '{"version": 0, "greedy": {"reward": 1e999, "length": 3}}',
    ):  # 1e999: Infinity once parsed
        queues.add_eval_result(r, keys, 0, 1, data)
    r.xadd(keys.eval_results, {"round": "zero", "data": encode_eval_result(good)})  # a field of the wrong type
    r.hset(keys.generators, "gen-junk", b"\x00\x01 not json")
    r.hset(keys.stats("learner"), mapping={"step": 3, "loss": "NaN", "reward_mean": b"\xff\xff"})
    r.xadd(keys.learner_metrics, {"step": 1, "data": '{"step": 1, "loss": NaN}'})  # not strict JSON
    r.xadd(keys.learner_metrics, {"step": 2, "data": '{"step": 2, "loss": 0.5}'})
    r.xadd(keys.events, {"kind": "published", "t": "soon", "data": "{}"})  # a time that is not a number
    r.xadd(keys.events, {"kind": "published", "t": "12.5", "data": b"\xff[1]"})

    st = httpx.get(f"{http}/api/state", timeout=10)
    assert st.status_code == 200
    st = _strict(st.text)  # no NaN made it through
    assert st["failures"]["malformed_records"] == {"heartbeats": 1, "stats": 2, "eval_results": 5, "eval_rounds": 1}
    assert set(st["failures"]["malformed_stats"]) == {"learner:loss", "learner:reward_mean"}
    assert st["learner"] == {"step": 3.0}
    [round0] = st["eval"]  # the good result still counts
    assert round0["version"] == 0 and round0["n_prompts"] == 1 and round0["pass@1"] == 1.0
    m = httpx.get(f"{http}/metrics", timeout=10)
    assert m.status_code == 200
    assert metric_value(m.text, "relay_broker_malformed_records", kind="eval_results") == 5
    assert metric_value(m.text, "relay_broker_malformed_records", kind="stats") == 2
    assert metric_value(m.text, "relay_eval_pass_at_1") == 1.0
    assert httpx.get(f"{http}/", timeout=10).status_code == 200
    learner = _strict(httpx.get(f"{http}/api/history/learner", timeout=10).text)["entries"]
    assert [e.get("loss", e.get("error")) for e in learner] == ["unreadable entry", 0.5]
    events = httpx.get(f"{http}/api/history/events", timeout=10).json()["entries"]
    assert [e["kind"] for e in events] == ["published"] and events[0]["t"] == 12.5
    # read again (the broker keeps what it read): the counts stay, the page stays up
    again = httpx.get(f"{http}/api/state", timeout=10).json()
    assert again["failures"]["malformed_records"]["eval_results"] == 5 and len(again["eval"]) == 1


def test_slow_and_idle_connections_do_not_stop_healthz(procs, redis_url, tmp_path):
    _, http = start_broker(procs, redis_url, tmp_path)
    host, port = http.removeprefix("http://").split(":")
    attackers = []
    for _ in range(300):  # more than the server's connection cap, each holding its request open
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"GET /api/state HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the head
        attackers.append(s)
    try:
        t0 = time.monotonic()
        for _ in range(3):
            assert httpx.get(f"{http}/healthz", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 5
        broker = next(c for c in procs.children if c.name == "broker")
        threads = int(next(ln.split()[1] for ln in open(f"/proc/{broker.pid}/status") if ln.startswith("Threads:")))
        assert threads < 60, threads  # a bounded pool, not a thread per held connection
        time.sleep(6)  # past the head deadline (5 s): the slow heads were answered 408 and closed
        m = httpx.get(f"{http}/metrics", timeout=5).text
        refused = metric_value(m, "relay_broker_http_refused")
        assert refused >= 300 and metric_value(m, "relay_broker_http_refused", reason="head_timeout") > 0
    finally:
        for s in attackers:
            s.close()
