"""Several broker ingest workers (broker.ingest_workers): each serves its own port, de-duplication and
the queue bound stay exact across them, a killed worker is restarted, and the broker stops them all."""

import os
import signal
import threading
from pathlib import Path

import redis

from broker.client.announcements import read_run_info
from broker.client.sender import GroupSender
from broker.client.telemetry import read_stats
from broker.protocol.group import encode_group
from broker.protocol.keys import Keys
from deploy.launcher.procs import free_port_run
from tests.support.data import announce_make_group_versions, make_group
from tests.support.services import announce_key, producer_keys, start_broker, wait_until


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (its ingest workers)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _items(prefix: str, n: int) -> list[tuple[str, bytes]]:
    return [(f"{prefix}{i}", encode_group(make_group(group_id=f"{prefix}{i}"))) for i in range(n)]


def test_two_ingest_workers_share_the_run_exactly_and_one_killed_is_restarted(procs, redis_url, tmp_path):
    base = free_port_run(2)
    start_broker(
        procs, redis_url, tmp_path, ingest_workers=2, ingest_bind=f"tcp://127.0.0.1:{base}", max_queue_groups=50
    )
    broker = procs.children[-1]
    w0, w1 = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    announce_make_group_versions(r, keys, announce_key(tmp_path))
    run = read_run_info(r, keys)
    assert run.ingest_address == w0 and run.ingest_addresses == f"{w0},{w1}"  # how a producer finds them all

    # each worker serves on its own; a group resent to the other worker is a duplicate, not a second copy
    first = _items("a", 10)
    acks = GroupSender(w0, timeout_s=10, curve=producer_keys(tmp_path)).send_many(first, window=8)
    assert {a.status for a in acks.values()} == {"ok"}
    again = GroupSender(w1, timeout_s=10, curve=producer_keys(tmp_path)).send_many(first, window=8)
    assert {a.status for a in again.values()} == {"duplicate"} and r.xlen(keys.trajectories) == 10

    # two producers, one per worker, racing for the last 40 places of the queue bound: exactly 40 get in
    results = {}

    def produce(address: str, prefix: str) -> None:
        sender = GroupSender(address, timeout_s=10, curve=producer_keys(tmp_path))
        try:
            results[prefix] = sender.send_many(_items(prefix, 30), window=8, give_up_s=3)
        except TimeoutError:  # the bound reached: the rest stay with the producer, busy
            results[prefix] = None
        results[prefix + "_busy"] = sender.busy_waits

    threads = [threading.Thread(target=produce, args=(w, p)) for w, p in ((w0, "x"), (w1, "y"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert r.xlen(keys.trajectories) == 50 and results["x_busy"] + results["y_busy"] > 0
    stats = read_stats(r, keys, "broker")
    assert stats["accepted"] == 50 and stats["duplicate"] == 10

    # a sender given both addresses spreads its groups; every one lands once
    r.xtrim(keys.trajectories, maxlen=0)  # the learner consumed them all
    both = GroupSender(f"{w0},{w1}", timeout_s=10, curve=producer_keys(tmp_path))
    acks = both.send_many(_items("s", 40), window=16)
    assert {a.status for a in acks.values()} == {"ok"} and r.xlen(keys.trajectories) == 40

    # worker 1 killed: the broker restarts it (counted), and it serves again on its port
    (worker,) = _children(broker.pid)
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: read_stats(r, keys, "broker").get("ingest_worker_restarts") == 1, 30, "worker 1 restarted")
    r.xtrim(keys.trajectories, maxlen=0)  # the learner consumed them all
    acks = GroupSender(w1, timeout_s=10, curve=producer_keys(tmp_path)).send_many(_items("z", 5), window=5)
    assert {a.status for a in acks.values()} == {"ok"}
    events = [f[b"kind"] for _, f in r.xrange(keys.events)]
    assert b"ingest_worker_restarted" in events

    # the broker stopped: so are its workers
    (restarted,) = _children(broker.pid)
    broker.proc.send_signal(signal.SIGTERM)
    assert broker.proc.wait(30) == 0
    wait_until(
        lambda: (
            not Path(f"/proc/{restarted}").exists() or Path(f"/proc/{restarted}/stat").read_text().split()[2] == "Z"
        ),
        30,
        "the worker to stop",
    )
