"""The run's embedded Redis, started on the port the plan chose, or on another one when that port was
taken in the meantime (redis-server binds its port itself and cannot be handed a socket, unlike the
other services, deploy/launcher/listeners.py): every service's Redis URL follows it."""

from __future__ import annotations

from pathlib import Path

from deploy.launcher.procs import ProcessGroup, RedisPortTaken, free_port, start_redis
from deploy.launcher.run_secrets import LAUNCHER_USER

TRIES = 5
SERVICES = ("broker", "learner", "generator")  # the services that talk to Redis


def point_at(p: dict, port: int) -> None:
    """Every Redis URL of the plan ``p`` (the services' and the launcher's) at the embedded Redis on ``port``,
    each with its user's credentials (none for a run from before Redis had users)."""
    users = p.get("redis_users")
    for name in SERVICES:
        p[name]["redis_url"] = users.url(name, port) if users is not None else f"redis://127.0.0.1:{port}/0"
    p["redis_url"] = users.url(LAUNCHER_USER, port) if users is not None else f"redis://127.0.0.1:{port}/0"
    p["redis_port"] = port


def start(procs: ProcessGroup, run_dir: Path, p: dict, aof: str, acl_file: Path | None) -> None:
    """redis-server on ``p["redis_port"]``; when that port is taken, on a free one (``p`` updated), at most
    :data:`TRIES` times."""
    for attempt in range(TRIES):
        try:
            start_redis(procs, run_dir, p["redis_port"], aof=aof, acl_file=acl_file)
            return
        except RedisPortTaken as e:
            procs.children.remove(e.child)
            if attempt == TRIES - 1:
                raise
            print(f"relay up: {e}; starting it on another port", flush=True)
            point_at(p, free_port())
