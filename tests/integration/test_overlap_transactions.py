"""broker/client/overlap.py: the broker's ingest writes a batch's transaction and reads its replies a
batch later, on one connection, in one thread. Whatever redis-py's ``Pipeline.execute`` would answer it
must answer too (the replies, the errors, a dead connection), with the messages sent as views. Real
redis-server."""

import pytest
import redis

from broker.client.overlap import OverlappedTransactions


def _pipe(r, *commands):
    pipe = r.pipeline()
    for c in commands:
        pipe.execute_command(*c)
    return pipe


def test_replies_are_those_of_the_same_transaction_through_redis_py(redis_url):
    r = redis.Redis.from_url(redis_url)
    ot = OverlappedTransactions(r)
    commands = [
        ("SET", "a", "1"),
        ("INCR", "a"),
        ("RPUSH", "l", "x", "y"),
        ("EVAL", "return {KEYS[1], ARGV[1], redis.call('GET', KEYS[1])}", 1, "a", "z"),
    ]
    ot.send(_pipe(r, *commands))
    assert ot.in_flight
    got = ot.results()
    assert not ot.in_flight
    # the raw replies (no redis-py response callbacks: the ingest reads the script's reply only)
    assert got == [b"OK", 2, 2, [b"a", b"z", b"2"]]
    r.delete("a", "l")
    raw = redis.Redis.from_url(redis_url)
    raw.response_callbacks.clear()
    assert _pipe(raw, *commands).execute() == got  # redis-py's own transaction, callbacks off
    ot.close()


def test_large_messages_go_as_views_and_arrive_whole(redis_url):
    """16 values of 1 MiB, passed as memoryviews: more than a socket buffer takes at once, so sendmsg
    sends them in parts; each arrives byte for byte."""
    r = redis.Redis.from_url(redis_url)
    ot = OverlappedTransactions(r)
    values = [bytearray((i * 7 + j) % 251 for j in range(256)) * 4096 for i in range(16)]
    ot.send(_pipe(r, *[("SET", f"k{i}", memoryview(v)) for i, v in enumerate(values)]))
    assert ot.results() == [b"OK"] * 16
    assert [r.get(f"k{i}") for i in range(16)] == [bytes(v) for v in values]
    ot.close()


def test_an_error_inside_exec_is_raised_and_the_connection_goes_on(redis_url):
    r = redis.Redis.from_url(redis_url)
    ot = OverlappedTransactions(r)
    r.set("s", "text")
    ot.send(_pipe(r, ("SET", "t", "1"), ("INCR", "s"), ("SET", "u", "2")))
    with pytest.raises(redis.ResponseError, match="not an integer"):
        ot.results()
    assert r.get("t") == b"1" and r.get("u") == b"2"  # MULTI/EXEC: the other commands ran, as Redis does
    ot.send(_pipe(r, ("INCR", "t")))
    assert ot.results() == [2]
    ot.close()


def test_a_command_refused_when_queued_aborts_the_transaction(redis_url):
    r = redis.Redis.from_url(redis_url)
    ot = OverlappedTransactions(r)
    ot.send(_pipe(r, ("SET", "v", "1"), ("GET",)))  # GET without a key: refused at queue time, EXECABORT
    with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
        ot.results()
    assert r.get("v") is None  # nothing of it ran
    ot.send(_pipe(r, ("SET", "v", "2")))
    assert ot.results() == [b"OK"] and r.get("v") == b"2"
    ot.close()


def test_a_connection_killed_in_flight_raises_and_the_next_transaction_reconnects(redis_url):
    r = redis.Redis.from_url(redis_url)
    ot = OverlappedTransactions(r)
    ot.send(_pipe(r, ("CLIENT", "SETNAME", "overlapped")))
    assert ot.results() == [b"OK"]
    ot.send(_pipe(r, ("SET", "w", "1")))
    ot.results()
    killed = [c for c in r.client_list() if c["name"] == "overlapped"]
    assert killed
    r.execute_command("CLIENT", "KILL", "ID", killed[0]["id"])
    with pytest.raises(redis.ConnectionError):
        ot.send(_pipe(r, ("SET", "w", "2")))
        ot.results()
    assert not ot.in_flight
    ot.send(_pipe(r, ("SET", "w", "3")))  # a new connection
    assert ot.results() == [b"OK"] and r.get("w") == b"3"
    ot.close()


def test_one_transaction_at_a_time(redis_url):
    r = redis.Redis.from_url(redis_url)
    ot = OverlappedTransactions(r)
    with pytest.raises(RuntimeError, match="no transaction in flight"):
        ot.results()
    ot.send(_pipe(r, ("SET", "x", "1")))
    with pytest.raises(RuntimeError, match="already in flight"):
        ot.send(_pipe(r, ("SET", "x", "2")))
    with pytest.raises(ValueError, match="empty"):
        OverlappedTransactions(r).send(r.pipeline())
    assert ot.results() == [b"OK"]
    ot.close()
