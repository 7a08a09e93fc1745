"""A flood of CURVE handshakes with keys the allow-list does not hold, on a real broker with real ZeroMQ:
each refusal is counted, but the broker's log gets a few lines and one summary per interval, not a line
per handshake (issue 44: 562 KB of log in 10 s)."""

import re
import time

import httpx
import zmq

from broker.ingest import DENIED_LOG_BURST, DENIED_LOG_INTERVAL_S
from broker.protocol.ingest_auth import load_client_keys
from tests.support.services import ingest_test_keys, metric_value, start_broker, wait_until

REFUSED = "refused a CURVE handshake from an unlisted key"


def _flood(address: str, server_public: bytes, seconds: float, sockets: int = 40) -> None:
    """Handshakes from fresh keys as fast as ZeroMQ reconnects (each socket retries every millisecond)."""
    ctx = zmq.Context()
    socks = []
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for s in socks:
                s.close(linger=0)
            socks = []
            for _ in range(sockets):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.RECONNECT_IVL, 1)
                s.curve_serverkey = server_public
                s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
                s.connect(address)
                socks.append(s)
            time.sleep(0.5)
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


def test_a_handshake_flood_is_counted_in_full_but_logged_at_a_bounded_rate(procs, redis_url, tmp_path):
    address, http = start_broker(procs, redis_url, tmp_path)
    log_path = next(c for c in procs.children if c.name == "broker").log_path
    before = log_path.stat().st_size
    server_public = load_client_keys(
        ingest_test_keys(tmp_path)["producer_key_file"], ingest_test_keys(tmp_path)["broker_public_key_file"]
    ).server
    t0 = time.monotonic()
    _flood(address, server_public, seconds=4)
    denied = metric_value(httpx.get(f"{http}/metrics", timeout=10).text, "relay_broker_ingest_denied_total")
    assert denied >= 50, denied  # a flood indeed (hundreds on a quiet machine), far above the 5 lines logged
    # the interval's summary comes when it ends, flood over or not
    wait_until(lambda: "not logged one by one" in log_path.read_text(), DENIED_LOG_INTERVAL_S + 10, "the summary")
    text = log_path.read_text()[before:]
    lines = text.splitlines()
    full = [ln for ln in lines if REFUSED in ln]
    intervals = int((time.monotonic() - t0) // DENIED_LOG_INTERVAL_S) + 1
    assert 1 <= len(full) <= DENIED_LOG_BURST * intervals, len(full)
    summaries = [int(m.group(1)) for ln in lines if (m := re.search(r"(\d+) more CURVE handshakes refused", ln))]
    final = metric_value(httpx.get(f"{http}/metrics", timeout=10).text, "relay_broker_ingest_denied_total")
    assert len(full) + sum(summaries) == final  # every refusal accounted for, in full or in a summary
    assert len(text) < 10_000, len(text)  # was ~56 KB a second of flood
