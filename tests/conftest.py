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


# -- where the suite's time goes: wall time against CPU time, per test ---------------------------
# The machines have 2 cores: a test whose CPU seconds (pytest's own and its reaped child processes')
# are far below its wall seconds waits (timers, polls, back-off) rather than computes, and could run
# beside others; one near 2x its wall keeps both cores busy. Printed after --durations.

_TIMES: list[tuple[float, float, str]] = []


def _cpu_seconds() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import time

    wall, cpu = time.perf_counter(), _cpu_seconds()
    yield
    _TIMES.append((time.perf_counter() - wall, _cpu_seconds() - cpu, item.nodeid))


def pytest_terminal_summary(terminalreporter):
    slow = sorted(_TIMES, reverse=True)[:25]
    if not slow or slow[0][0] < 10:
        return
    total_wall, total_cpu = sum(t[0] for t in _TIMES), sum(t[1] for t in _TIMES)
    terminalreporter.section(f"wall vs CPU seconds (pytest and its child processes), {len(_TIMES)} tests: "
                             f"{total_wall:.0f} s wall, {total_cpu:.0f} s CPU")
    for wall, cpu, nodeid in slow:
        terminalreporter.write_line(f"{wall:8.1f}s wall {cpu:8.1f}s cpu  {cpu / wall:4.2f} cores  {nodeid}")
