"""relay up's supervisor on real child processes (short Python scripts, no services): a child killed
with SIGKILL is restarted with the same command after the back-off, pids.json follows it, a clean
exit is not restarted, and a child past its restart budget fails the run."""

import json
import signal
import sys
import time

import pytest

from deploy.launcher.procs import ProcessGroup
from deploy.launcher.supervisor import GiveUp, RestartPolicy, Supervisor
from tests.support.services import wait_until

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"]


@pytest.fixture
def group(tmp_path):
    g = ProcessGroup(tmp_path / "logs")
    yield g
    g.stop(timeout=5)


def test_backoff_doubles_up_to_its_cap():
    p = RestartPolicy(backoff_s=0.5, backoff_max_s=10.0)
    assert [p.delay(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_killed_child_is_restarted_with_the_same_command(group, tmp_path):
    group.start("svc", SLEEPER)
    sup = Supervisor(group, RestartPolicy(max_restarts=3, backoff_s=0.2), tmp_path / "pids.json", ["svc"])
    first = sup.child("svc").pid
    assert json.loads((tmp_path / "pids.json").read_text()) == {"svc": first}
    for n in (1, 2):
        old = sup.child("svc")
        wait_until(lambda: old.log_path.read_text().count("up") == n, 30, f"start {n} in the log")
        old.proc.send_signal(signal.SIGKILL)
        old.proc.wait(5)
        t0 = time.monotonic()
        wait_until(lambda: (sup.poll(lambda: False), sup.child("svc").alive())[1], 10, "restart")
        waited = time.monotonic() - t0
        new = sup.child("svc")
        assert new.pid != old.pid and new.argv == SLEEPER
        assert waited >= 0.2 * 2 ** (n - 1) - 0.05  # the back-off doubles for a child that died quickly
        assert json.loads((tmp_path / "pids.json").read_text()) == {"svc": new.pid}
        assert sup.restarts["svc"] == n
    assert len(group.children) == 1
    wait_until(lambda: new.log_path.read_text().count("up") == 3, 30, "three starts in one log")


def test_once_the_run_is_finished_nothing_is_restarted(group, tmp_path):
    group.start("learner", [sys.executable, "-c", "pass"])  # finished its steps
    group.start("gen-0", [sys.executable, "-c", "import sys; sys.exit(3)"])  # died after the end
    sup = Supervisor(group, RestartPolicy(backoff_s=0.05), tmp_path / "pids.json", ["learner", "gen-0"])
    for c in group.children:
        c.proc.wait(10)
    for _ in range(5):
        sup.poll(lambda: True)
        time.sleep(0.06)
    assert sup.total() == 0 and not any(c.alive() for c in group.children)


def test_a_clean_exit_is_not_restarted(group, tmp_path):
    group.start("learner", [sys.executable, "-c", "pass"])  # the learner's clean exit ends the run
    group.start("gen-0", [sys.executable, "-c", "pass"])  # a generator quitting early is a failure
    sup = Supervisor(group, RestartPolicy(backoff_s=0.05), tmp_path / "pids.json", ["learner", "gen-0"])
    for c in group.children:
        c.proc.wait(10)
    with pytest.raises(GiveUp, match=r"gen-0 .* clean exit before the run finished is not restarted"):
        sup.poll(lambda: False)
    assert sup.total() == 0


def test_past_its_budget_a_service_fails_the_run(group, tmp_path):
    group.start("broker", [sys.executable, "-c", "import sys; sys.exit(1)"])
    sup = Supervisor(group, RestartPolicy(max_restarts=2, backoff_s=0.05), tmp_path / "pids.json", ["broker"])
    with pytest.raises(GiveUp, match=r"restart budget spent \(2 of --max-restarts 2\)"):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            sup.poll(lambda: False)
            time.sleep(0.02)
    assert sup.restarts["broker"] == 2


def test_a_service_that_may_not_restart_fails_the_run_at_once(group, tmp_path):
    group.start("learner", [sys.executable, "-c", "import sys; sys.exit(1)"])
    group.children[0].proc.wait(10)
    sup = Supervisor(
        group, RestartPolicy(), tmp_path / "pids.json", ["learner"], {"learner": "learner.publish.checkpoint_every = 0"}
    )
    with pytest.raises(GiveUp, match="not restarted: learner.publish.checkpoint_every = 0"):
        sup.poll(lambda: False)
    assert sup.total() == 0


def test_a_service_that_dies_before_it_first_became_healthy_is_not_restarted(group, tmp_path):
    """A start-up failure (a bad dataset, a port taken) would fail the same way on every restart: the
    run stops at once with the service's last error; a service that was up once is restarted."""
    fail = tmp_path / "fail-now"  # the broker fails once the first poll has seen it alive (no race)
    group.start(
        "broker",
        [
            sys.executable,
            "-c",
            "import os, sys, time; print('starting', flush=True)\n"
            f"while not os.path.exists({str(fail)!r}): time.sleep(0.02)\n"
            "sys.exit('ValueError: dataset.path does not exist')",
        ],
    )
    group.start("gen-0", SLEEPER)
    up = {"gen-0"}  # what the health probe reports
    sup = Supervisor(
        group,
        RestartPolicy(backoff_s=0.05),
        tmp_path / "pids.json",
        ["broker", "gen-0"],
        healthy=lambda name: name in up,
    )
    sup.poll(lambda: False)  # gen-0 is seen healthy; the broker is still starting
    fail.touch()
    group.children[0].proc.wait(10)
    with pytest.raises(GiveUp, match="failed at start-up, before it first became healthy") as e:
        sup.poll(lambda: False)
    assert e.value.at_start and e.value.child.name == "broker"
    assert e.value.last_error() == "ValueError: dataset.path does not exist"
    assert sup.total() == 0

    gen = sup.child("gen-0")  # it came up before it died: restarted as usual
    gen.proc.send_signal(signal.SIGKILL)
    gen.proc.wait(5)
    sup.services.remove("broker")
    wait_until(lambda: (sup.poll(lambda: False), sup.child("gen-0").alive())[1], 10, "restart of gen-0")
    assert sup.restarts["gen-0"] == 1


def test_a_frozen_child_is_taken_for_hung_killed_and_restarted(group, tmp_path):
    """A child that stops showing signs of life (frozen with SIGSTOP: it is alive, but its heartbeat
    stops) is killed after hang_s, counted as a hang, and restarted like any dead service; one that
    keeps signalling is left alone."""
    group.start("gen-0", SLEEPER)
    group.start("gen-1", SLEEPER)
    frozen: set[int] = set()
    sup = Supervisor(
        group,
        RestartPolicy(backoff_s=0.05, hang_s=1.5, probe_every_s=0.1),
        tmp_path / "pids.json",
        ["gen-0", "gen-1"],
        alive_at=lambda name: None if sup.child(name).pid in frozen else time.time(),
    )
    old = sup.child("gen-0")
    for _ in range(10):  # both signal: nothing happens
        sup.poll(lambda: False)
        time.sleep(0.05)
    assert sup.hangs == {} and old.alive()
    old.proc.send_signal(signal.SIGSTOP)
    frozen.add(old.pid)
    t0 = time.monotonic()
    wait_until(lambda: (sup.poll(lambda: False), sup.child("gen-0").pid != old.pid)[1], 20, "the hung child restarted")
    assert time.monotonic() - t0 >= 1.4  # not before hang_s of silence
    assert sup.hangs["gen-0"] == 1 and sup.restarts["gen-0"] == 1 and old.proc.returncode == -signal.SIGKILL
    assert sup.child("gen-0").alive() and sup.child("gen-1").alive() and sup.hangs["gen-1"] == 0


def test_a_service_that_keeps_failing_for_the_same_reason_fails_the_run_with_it(group, tmp_path, capsys):
    """A service that came up and then dies again and again on the same error (a custom environment that
    fails as each generator starts on it) stops the run after 3 such deaths, with that error, instead of
    being restarted up to its budget; each death is printed with its error line."""
    crash = [sys.executable, "-c", "print('serving', flush=True); raise ValueError('the environment failed at start')"]
    group.start("gen-0", crash)
    sup = Supervisor(group, RestartPolicy(max_restarts=10, backoff_s=0.05), tmp_path / "pids.json", ["gen-0"])
    with pytest.raises(GiveUp, match="failed 3 times in a row with the same error") as e:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sup.poll(lambda: False)
            time.sleep(0.02)
    assert e.value.last_error() == "ValueError: the environment failed at start"
    assert sup.restarts["gen-0"] == 2 and sup.errors["gen-0"] == "ValueError: the environment failed at start"
    err = capsys.readouterr().err
    assert "gen-0 (pid" in err and "died (code 1)" in err
    assert ": ValueError: the environment failed at start; restart 1/10" in err


def test_another_error_or_a_kill_starts_the_count_over(group, tmp_path):
    """Deaths on different errors, or kills by a signal (which say nothing about the service), are
    restarted up to the budget as before."""
    n = tmp_path / "n"
    n.write_text("0")
    flip = [
        sys.executable,
        "-c",
        f"import pathlib; p = pathlib.Path({str(n)!r}); k = int(p.read_text()); "
        "p.write_text(str(k + 1)); raise SystemExit(f'RuntimeError: failure number {k % 2}')",
    ]
    group.start("gen-0", flip)
    sup = Supervisor(group, RestartPolicy(max_restarts=4, backoff_s=0.05), tmp_path / "pids.json", ["gen-0"])
    with pytest.raises(GiveUp, match="restart budget spent"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sup.poll(lambda: False)
            time.sleep(0.02)
    assert sup.restarts["gen-0"] == 4


def test_a_configuration_error_exit_is_not_restarted(group, tmp_path):
    """Exit code 2 is a configuration error (relay <service> on a bad config; a generator whose reward token or
    ingest key is refused): a restart would meet it again, so the run stops at once with its reason."""
    group.start(
        "gen-0",
        [
            sys.executable,
            "-c",
            "import sys; print('the reward service refused the generator\\'s token', file=sys.stderr); sys.exit(2)",
        ],
    )
    group.children[0].proc.wait(10)
    sup = Supervisor(group, RestartPolicy(), tmp_path / "pids.json", ["gen-0"])
    with pytest.raises(GiveUp, match=r"configuration error \(exit code 2\)") as e:
        sup.poll(lambda: False)
    assert sup.total() == 0 and "refused the generator's token" in e.value.last_error()
