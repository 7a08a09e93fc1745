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
    for cmd in (("GET", f"relay:{RUN}:latest"), ("SET", f"relay:{RUN}:latest", "forged"), ("FLUSHALL",),
                ("KEYS", "*")):
        with pytest.raises(redis.AuthenticationError):
            anon.execute_command(*cmd)
    for url in (f"redis://default:@127.0.0.1:{port}/0", f"redis://learner:wrong@127.0.0.1:{port}/0",
                f"redis://default:{users.passwords['learner']}@127.0.0.1:{port}/0"):
        with pytest.raises(redis.AuthenticationError):
            _client(url).ping()


def test_a_service_user_reaches_only_the_runs_keys_and_no_dangerous_command(acl_redis):
    users, port = acl_redis
    gen = _client(users.url("generator", port))
    gen.set(f"relay:{RUN}:issued", 1)
    assert gen.get(f"relay:{RUN}:issued") == b"1"
    gen.publish(f"relay:{RUN}:announce", b"x")
    for cmd in (("SET", "relay:other:latest", "x"), ("GET", "relay:other:latest"), ("SET", "elsewhere", "x"),
                ("PUBLISH", "relay:other:announce", "x"), ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"),
                ("CONFIG", "SET", "dir", "/tmp"), ("KEYS", "*"), ("SAVE",), ("SWAPDB", "0", "1"), ("SHUTDOWN",),
                ("ACL", "LIST"), ("MONITOR",), ("CLIENT", "KILL", "TYPE", "normal")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            gen.execute_command(*cmd)
    assert gen.get(f"relay:{RUN}:issued") == b"1"  # nothing was flushed
    # the launcher only watches: it reads the run's keys (and INFO), writes nothing
    watcher = _client(users.url("launcher", port))
    assert watcher.get(f"relay:{RUN}:issued") == b"1" and "used_memory" in watcher.info("memory")
    for cmd in (("SET", f"relay:{RUN}:latest", "forged"), ("DEL", f"relay:{RUN}:issued"),
                ("HSET", f"relay:{RUN}:versions", "9", "x")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            watcher.execute_command(*cmd)


def test_run_redis_url_gives_the_launchers_credentials(tmp_path):
    users = RedisUsers.new(RUN)
    users.write(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "broker.json").write_text(
        '{"run_id": "acl", "redis_url": "redis://broker:***@127.0.0.1:6399/0"}')
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
