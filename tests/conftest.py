"""Shared fixtures: a real redis-server on a free port, service processes started and stopped by PID.
Helpers live in tests/support/."""

from __future__ import annotations

import pytest

from deploy.launcher.procs import ProcessGroup, free_port, start_redis

_START = pytest.StashKey[tuple]()


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
# The machines have 2 cores: a test whose CPU seconds (its process's own and its reaped child processes')
# are far below its wall seconds waits (timers, polls, back-off) rather than computes, and runs well beside
# another (make test runs two test files at a time); one near 2x its wall keeps both cores busy. Printed
# after --durations. Each test's figures travel on its teardown report, so that with pytest-xdist the
# controller, which prints the table, gets those its workers measured.

_TIMES: list[tuple[float, float, str]] = []
_KEY = "relay_wall_cpu_s"


@pytest.fixture
def peers():
    """Subprocesses a test starts (tests/support/peers.py); killed at its end if still running."""
    ps = []
    yield ps
    for p in ps:
        if p.poll() is None:
            p.kill()
            p.wait()


def _cpu_seconds() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    import time

    item.stash[_START] = (time.perf_counter(), _cpu_seconds())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    import time

    outcome = yield
    start = item.stash.get(_START, None)
    if call.when == "teardown" and start is not None:
        outcome.get_result().user_properties.append((_KEY, [time.perf_counter() - start[0], _cpu_seconds() - start[1]]))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == _KEY:
                _TIMES.append((value[0], value[1], report.nodeid))


def pytest_terminal_summary(terminalreporter):
    slow = sorted(_TIMES, reverse=True)[:25]
    if not slow or slow[0][0] < 10:
        return
    total_wall, total_cpu = sum(t[0] for t in _TIMES), sum(t[1] for t in _TIMES)
    terminalreporter.section(
        f"wall vs CPU seconds (pytest and its child processes), {len(_TIMES)} tests: "
        f"{total_wall:.0f} s wall, {total_cpu:.0f} s CPU"
    )
    for wall, cpu, nodeid in slow:
        terminalreporter.write_line(f"{wall:8.1f}s wall {cpu:8.1f}s cpu  {cpu / wall:4.2f} cores  {nodeid}")
