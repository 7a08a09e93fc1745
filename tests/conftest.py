"""Shared fixtures: a real redis-server on a free port, service processes started and stopped by PID.
Helpers live in tests/support/."""

from __future__ import annotations

import pytest

from deploy.launcher.procs import ProcessGroup, free_port, start_redis


@pytest.fixture
def procs(tmp_path):
    group = ProcessGroup(tmp_path / "logs")
    yield group
    group.stop(timeout=5)


@pytest.fixture
def redis_url(procs, tmp_path) -> str:
    """A real redis-server of our own on a free port (never the shared 6379)."""
    _, url = start_redis(procs, tmp_path, free_port())
    return url
