"""The embedded Redis as ``relay up`` starts it (deploy/launcher/run_secrets.py, procs.start_redis), tried
as another local user would: with no password, with a service's password beyond its rights."""

import os
import stat

import pytest
import redis

from deploy.launcher.procs import free_port, start_redis
from deploy.launcher.run_secrets import USERS, RedisUsers, run_redis_url

RUN = "acl"


@pytest.fixture
def acl_redis(procs, tmp_path):
    users = RedisUsers.new(RUN)
    acl = users.write(tmp_path)
    port = free_port()
    start_redis(procs, tmp_path, port, acl_file=acl)
    return users, port


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5)


def test_secrets_are_private_files(acl_redis, tmp_path):
    folder = tmp_path / "secrets" / "redis"
    assert stat.S_IMODE(os.stat(tmp_path / "secrets").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for name in [f"{u}.password" for u in USERS] + ["users.acl"]:
        assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o600, name
    users, _ = acl_redis
    acl = (folder / "users.acl").read_text()
    assert all(p not in acl for p in users.passwords.values())  # the ACL file holds hashes only
    assert "user default on resetpass" in acl  # nobody can log in as default (it replays the AOF)
    assert RedisUsers.read(tmp_path, RUN).passwords == users.passwords  # what --resume reads back


def test_without_the_password_nothing_of_the_run_can_be_read_or_written(acl_redis):
    users, port = acl_redis
    anon = _client(f"redis://127.0.0.1:{port}/0")
    for cmd in (("GET", f"relay:{RUN}:latest"), ("SET", f"relay:{RUN}:latest", "forged"), ("FLUSHALL",), ("KEYS", "*")):
        with pytest.raises(redis.AuthenticationError):
            anon.execute_command(*cmd)
    for url in (
        f"redis://default:@127.0.0.1:{port}/0",
        f"redis://learner:wrong@127.0.0.1:{port}/0",
        f"redis://default:{users.passwords['learner']}@127.0.0.1:{port}/0",
    ):
        with pytest.raises(redis.AuthenticationError):
            _client(url).ping()


def test_a_service_user_reaches_only_the_runs_keys_and_no_dangerous_command(acl_redis):
    users, port = acl_redis
    gen = _client(users.url("generator", port))
    gen.hset(f"relay:{RUN}:generators", "g", b"{}")  # its heartbeat
    assert gen.incrby(f"relay:{RUN}:issued", 1) == 1
    assert gen.get(f"relay:{RUN}:issued") == b"1"
    for cmd in (
        ("SET", "relay:other:latest", "x"),
        ("GET", "relay:other:latest"),
        ("SET", "elsewhere", "x"),
        ("PUBLISH", "relay:other:announce", "x"),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "dir", "/tmp"),
        ("KEYS", "*"),
        ("SAVE",),
        ("SWAPDB", "0", "1"),
        ("SHUTDOWN",),
        ("ACL", "LIST"),
        ("MONITOR",),
        ("CLIENT", "KILL", "TYPE", "normal"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            gen.execute_command(*cmd)
    assert gen.get(f"relay:{RUN}:issued") == b"1"  # nothing was flushed
    # the launcher only watches: it reads the run's keys (and INFO), writes nothing
    watcher = _client(users.url("launcher", port))
    assert watcher.get(f"relay:{RUN}:issued") == b"1" and "used_memory" in watcher.info("memory")
    for cmd in (
        ("SET", f"relay:{RUN}:latest", "forged"),
        ("DEL", f"relay:{RUN}:issued"),
        ("HSET", f"relay:{RUN}:versions", "9", "x"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            watcher.execute_command(*cmd)


def _denied(client: redis.Redis, *cmd) -> bool:
    """Whether Redis refuses ``cmd`` to this user (a refusal inside a script is an error too)."""
    try:
        client.execute_command(*cmd)
    except redis.exceptions.NoPermissionError:
        return True
    except redis.exceptions.ResponseError as e:
        return "can't" in str(e) or "no permissions" in str(e)
    return False


def test_the_generators_user_cannot_write_the_replay_queue_nor_an_announcement(acl_redis):
    """With a generator's password (its stolen files): no group written straight into the trajectories stream
    (only the broker writes it), no message, no announcement, no prompt of one's own, no admission bound, not
    even a read of the training data; what a generator does (claim prompts, admission, heartbeats, events) works."""
    from broker.client import queues
    from broker.protocol.group import encode_group
    from broker.protocol.keys import Keys
    from tests.support.data import make_group

    users, port = acl_redis
    keys = Keys(RUN)
    broker, gen = _client(users.url("broker", port)), _client(users.url("generator", port))
    queues.ensure_groups(broker, keys)
    pipe = broker.pipeline()  # the broker's own append: it may
    queues.append_groups(pipe, keys, 100, 1 << 30, [(g, encode_group(g)) for g in [make_group(group_id="real")]])
    pipe.execute()
    assert broker.xlen(keys.trajectories) == 1
    payload = encode_group(make_group(group_id="forged"))
    eid = broker.xrange(keys.trajectories)[0][0].decode()
    for cmd in (
        ("XADD", keys.trajectories, "*", "gid", "forged", "v", "3", "gen", "gen-0"),
        ("SET", keys.payload("9999999999999-0"), payload),
        ("SET", keys.payload(eid), payload),
        ("DEL", keys.payload(eid)),
        ("XDEL", keys.trajectories, eid),
        ("SADD", keys.seen, "x"),
        ("SET", keys.staged("x"), payload),
        ("GET", keys.payload(eid)),
        ("XLEN", keys.trajectories),
        ("SET", keys.latest, b"forged"),
        ("HSET", keys.versions, "1000000000", b"forged"),
        ("PUBLISH", keys.announce, b"forged"),
        ("HSET", keys.admission, "eta", "1000000"),
        ("HSET", keys.stats("learner"), "consumed", "0"),
        ("SET", keys.done, "over"),
        ("XADD", keys.prompts, "*", "prompt", "mine"),
        ("HSET", keys.run, "reward_url", "http://evil"),
        ("HSET", keys.collective, "host", "evil"),
        ("HSET", keys.ipc, "current", "x"),
    ):
        assert _denied(gen, *cmd), cmd
    # nor through a script: EVAL passes only the keys a generator may touch, and each command inside is checked
    assert _denied(gen, "EVAL", "return redis.call('XADD', KEYS[1], '*', 'gid', 'x')", 1, keys.trajectories)
    assert _denied(gen, "EVAL", "return redis.call('XADD', KEYS[1], '*', 'prompt', 'x')", 1, keys.prompts)
    assert _denied(gen, "EVAL", "return redis.call('HSET', KEYS[1], 'consumed', 0)", 1, keys.stats("learner"))
    assert broker.xlen(keys.trajectories) == 1 and broker.get(keys.latest) is None
    # what a generator does
    broker.xadd(keys.prompts, {"prompt": "p"})
    granted, got = queues.admit_and_claim(gen, keys, "gen-0", 1)
    assert granted == 1 and len(got) == 1
    assert queues.renew_claims(gen, keys.prompts, "gen-0", [got[0][0]]) == {got[0][0]}
    pipe = gen.pipeline()
    queues.release(pipe, keys.prompts, got[0][0])
    pipe.execute()
    from broker.client.telemetry import emit_event

    emit_event(gen, keys, "applied", generator="gen-0", version=1)
    assert gen.hsetnx(keys.run, "reward_url", "http://reward") == 1
    assert gen.hsetnx(keys.run, "reward_url", "http://evil") == 0  # what is there stays


def test_run_redis_url_gives_the_launchers_credentials(tmp_path):
    users = RedisUsers.new(RUN)
    users.write(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "broker.json").write_text(
        '{"run_id": "acl", "redis_url": "redis://broker:***@127.0.0.1:6399/0"}'
    )
    assert run_redis_url(tmp_path) == users.url("launcher", 6399)


def test_a_restarted_redis_replays_every_transaction_of_its_append_only_file(tmp_path):
    """`relay up --resume`: the run's Redis comes back from its AOF, transactions included (Redis 7
    replays them as `default`, checked against the ACL file)."""
    from deploy.launcher.procs import ProcessGroup

    users = RedisUsers.new(RUN)
    acl = users.write(tmp_path)
    port = free_port()
    for part in range(2):
        procs = ProcessGroup(tmp_path / f"logs{part}")
        try:
            start_redis(procs, tmp_path, port, aof="always", acl_file=acl)
            learner = _client(users.url("learner", port))
            if part == 0:
                with learner.pipeline(transaction=True) as pipe:
                    pipe.set(f"relay:{RUN}:latest", b"v1").hset(f"relay:{RUN}:versions", "1", b"v1").execute()
            else:
                assert learner.get(f"relay:{RUN}:latest") == b"v1"
                assert learner.hget(f"relay:{RUN}:versions", "1") == b"v1"
        finally:
            procs.stop()
