"""The collective transport's rendezvous tried as a local attacker would (learner/rendezvous.py): the learner's
broadcaster in this process, a real generator as a subprocess (tests/support/collective_peer.py), real Redis,
real sockets and gloo groups. Without the run's weights key a join gets nothing, and many joins cost the learner
no thread; with it (a generator's stolen files), an id already connected is refused, not evicted; a generator
that restarts rejoins under its id."""

import datetime
import json
import os
import socket
import threading
import time

import pytest
import torch.distributed as dist

from broker.client.connection import connect_redis
from broker.protocol import collective as wire
from broker.protocol.keys import Keys
from broker.protocol.tensordigest import state_digest
from broker.protocol.weights_config import CollectiveTransport
from learner.broadcast import Broadcaster
from learner.tiny_model import build_tiny_model
from tests.support.peers import moved_version, peer_result, start_peer
from tests.support.services import announce_key, wait_until, weights_key

RUN = "rdv"


def _threads() -> int:
    """The OS threads of this process (the learner's side lives here): Python's and gloo's."""
    return len(os.listdir("/proc/self/task"))


def _store_join(host: str, port: int, generator: str, ticket_count: int = 1) -> str:
    """A join as the rendezvous spoke it before it was authenticated: a ticket in the learner's TCPStore,
    ``join/<ticket>`` naming ``generator``, then rank 1 of the group ``member/<ticket>``. Returns what the
    attacker got: "group" (a member: it receives every version), or the error that stopped it."""
    try:
        store = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=5)
        )
        tickets = [store.add("joins", 1) for _ in range(ticket_count)]
        for t in tickets:
            store.set(f"join/{t}", json.dumps({"generator": generator, "session": "attacker"}))
        if ticket_count > 1:
            return "tickets"
        wire.gloo_group(store, f"member/{tickets[0]}", 1, host, 5)
        return "group"
    except (RuntimeError, ValueError, OSError) as e:  # DistStoreError and friends: no group
        return f"refused: {str(e).splitlines()[0][:100]}"


def _address(r, keys) -> tuple[str, int]:
    addr = r.hgetall(keys.collective)
    return addr[b"host"].decode(), int(addr[b"port"])


@pytest.fixture
def learner(redis_url, tmp_path):
    r, keys = connect_redis(redis_url), Keys(RUN)
    b = Broadcaster(
        r,
        keys,
        CollectiveTransport(bucket_mb=1 / 16, timeout_s=30),
        announce_key(tmp_path),
        weights_key=weights_key(tmp_path),
    ).start()
    yield b, r, keys
    b.close()


def test_a_join_without_the_weights_key_gets_nothing_and_does_not_evict_the_generator_of_that_id(
    learner, redis_url, tmp_path, peers
):
    b, r, keys = learner
    model = build_tiny_model(tmp_path / "model")
    real = start_peer(peers, redis_url, tmp_path, model, "gen-0", RUN, "--until", "1")
    wait_until(lambda: b.member_ids() == ["gen-0"], timeout=60, what="gen-0 joined")
    host, port = _address(r, keys)
    # it listens on the configured host only (the TCPStore it replaced listened on every interface)
    import psutil

    listening = {
        c.laddr.ip
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }
    assert listening == {"127.0.0.1"}, listening
    # the attack that worked before: join as gen-0 through the rendezvous store
    got = _store_join(host, port, "gen-0")
    assert got.startswith("refused"), got
    # the rendezvous's own protocol, with no key, or with another run's key
    from generators.weight_receive import Receiver

    for key in (None, b"\x01" * 32):
        intruder = Receiver(r, keys, CollectiveTransport(timeout_s=5), "gen-0", None, key)
        with pytest.raises((ConnectionError, RuntimeError, ValueError)):
            intruder._join()
        assert intruder.pg is None
        intruder._leave()
    time.sleep(0.5)
    assert b.member_ids() == ["gen-0"]  # the real one kept its place
    v1 = moved_version(model, 0.01)
    t0 = time.monotonic()
    assert b.send(1, v1) == state_digest(v1)
    assert time.monotonic() - t0 < 10  # no member of the attacker's to wait timeout_s (30 s) for
    res = peer_result(real, tmp_path, "gen-0")
    assert res["version"] == 1 and res["engine_digest"] == state_digest(v1)
    assert b.rendezvous.counts["refused_unauthenticated"] >= 3


def test_a_thousand_joins_without_the_key_cost_the_learner_no_thread_and_no_broadcast_time(
    learner, redis_url, tmp_path, peers
):
    b, r, keys = learner
    model = build_tiny_model(tmp_path / "model")
    real = start_peer(peers, redis_url, tmp_path, model, "gen-0", RUN, "--until", "1")
    wait_until(lambda: b.member_ids() == ["gen-0"], timeout=60, what="gen-0 joined")
    host, port = _address(r, keys)
    before = _threads()
    _store_join(host, port, "nobody", ticket_count=300)  # before: one learner thread per ticket
    peak = _threads()
    socks, stop = [], threading.Event()

    def flood() -> None:  # connections that say nothing, or garbage, as fast as they open
        i = 0
        while not stop.is_set():
            try:
                s = socket.create_connection((host, port), timeout=2)
                s.sendall(b"\xff" * 64 if i % 2 else b"")
                socks.append(s)
                if len(socks) > 200:
                    socks.pop(0).close()
            except OSError:
                pass
            i += 1

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
    for t in flooders:
        t.start()
    try:
        time.sleep(2.0)
        peak = max(peak, _threads())
        v1 = moved_version(model, 0.01)
        t0 = time.monotonic()
        assert b.send(1, v1) == state_digest(v1)
        send_s = time.monotonic() - t0
        peak = max(peak, _threads())
    finally:
        stop.set()
        for t in flooders:
            t.join(5)
        for s in socks:
            s.close()
    assert peak - before - len(flooders) < 10, f"{before} threads before the joins, {peak} during"
    assert send_s < 10, f"a broadcast took {send_s:.1f} s during the flood"
    assert peer_result(real, tmp_path, "gen-0")["version"] == 1
    assert b.rendezvous.counts["refused_unauthenticated"] + b.rendezvous.counts["refused_busy"] > 100


def test_with_the_key_a_duplicate_id_is_refused_and_a_restarted_generator_rejoins(learner, redis_url, tmp_path, peers):
    """A generator's stolen files hold the weights key: they may receive versions (documented), but joining
    under a live generator's id does not evict it; once that generator's process is gone, its id is free."""
    from generators.weight_receive import Receiver

    b, r, keys = learner
    model = build_tiny_model(tmp_path / "model")
    real = start_peer(peers, redis_url, tmp_path, model, "gen-0", RUN, "--until", "99")
    wait_until(lambda: b.member_ids() == ["gen-0"], timeout=60, what="gen-0 joined")
    thief = Receiver(r, keys, CollectiveTransport(timeout_s=10), "gen-0", None, weights_key(tmp_path))
    with pytest.raises(RuntimeError, match="already connected"):
        thief._join()
    thief._leave()
    assert b.member_ids() == ["gen-0"] and b.rendezvous.counts["refused_duplicate"] == 1
    real.kill()  # the generator dies; relay up would start it again under the same id
    real.wait()
    wait_until(lambda: b.member_ids() == [], timeout=10, what="gen-0's membership ended with its process")
    again = start_peer(peers, redis_url, tmp_path, model, "gen-0", RUN, "--until", "1")
    wait_until(lambda: b.member_ids() == ["gen-0"], timeout=60, what="the restarted gen-0 rejoined")
    v1 = moved_version(model, 0.01)
    b.send(1, v1)
    assert peer_result(again, tmp_path, "gen-0")["engine_digest"] == state_digest(v1)
