"""Redis killed (SIGKILL) and restarted mid-stream with the append-only file fsynced on every write:
no group the broker acknowledged as appended is lost, and the producer and the broker carry on by
themselves (reconnect with back-off, resend the same bytes)."""

import signal
import threading
import time

import redis

from broker.client.sender import GroupSender
from broker.protocol.keys import Keys
from broker.protocol.group import encode_group
from deploy.launcher.procs import ProcessGroup, free_port, start_redis
from tests.support.services import announce_key, producer_keys, start_broker
from tests.support.data import announce_make_group_versions, make_group


def test_acknowledged_groups_survive_a_redis_kill(procs, tmp_path):
    data = tmp_path / "redis-data"
    data.mkdir()
    port = free_port()
    redis_procs = ProcessGroup(tmp_path / "redis-logs")  # stopped and restarted on its own
    try:
        child, url = start_redis(redis_procs, data, port, aof="always")
        address, _ = start_broker(procs, url, tmp_path, max_queue_groups=10**6)
        announce_make_group_versions(redis.Redis.from_url(url), Keys("r"), announce_key(tmp_path))
        acked: list[str] = []
        stop = threading.Event()

        def produce():
            sender = GroupSender(address, timeout_s=2.0, curve=producer_keys(tmp_path))
            i = 0
            while not stop.is_set():
                gid = f"g{i}"
                ack = sender.send(gid, encode_group(make_group(group_id=gid)), give_up_s=60)
                assert ack.status in ("ok", "duplicate"), ack  # duplicate: an earlier try was appended
                acked.append(gid)
                i += 1

        t = threading.Thread(target=produce, daemon=True)
        t.start()
        while len(acked) < 200:
            time.sleep(0.01)
        child.proc.send_signal(signal.SIGKILL)  # no shutdown, no final flush
        child.proc.wait(5)
        n_before = len(acked)
        time.sleep(1.0)  # the broker now finds Redis gone; the producer waits for acks and resends
        child, _ = start_redis(redis_procs, data, port, aof="always")
        deadline = time.monotonic() + 60
        while len(acked) < n_before + 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        t.join(30)
        assert len(acked) >= n_before + 200, "the producer did not resume after the Redis restart"
        r, keys = redis.Redis.from_url(url), Keys("r")
        in_stream = {f[b"gid"].decode() for _, f in r.xrange(keys.trajectories)}
        missing = [g for g in acked if g not in in_stream]
        assert not missing, f"{len(missing)} acknowledged groups lost, e.g. {missing[:5]}"
        assert len(in_stream) == r.xlen(keys.trajectories)  # and none appended twice
        broker = next(c for c in procs.children if c.name == "broker")
        assert broker.alive()
        assert "redis unavailable" in broker.log_path.read_text()
    finally:
        redis_procs.stop(timeout=5)
