"""The runs folder's lock (deploy/launcher/rundir.py): held by one relay up at a time, refused to a second
with the run that holds it and the fix, and gone with the process that held it, however it ended (an
flock, not a PID file that a killed run leaves behind)."""

import os
import signal
import subprocess
import sys

import pytest

from deploy.launcher.rundir import LOCK, RunsFolderError, RunsLock, link_base_model
from tests.support.services import ROOT

_HOLDER = """
import sys, time
from pathlib import Path
from deploy.launcher.rundir import RunsLock
lock = RunsLock(Path(sys.argv[1])).acquire("first")  # held while the process lives
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_run_in_a_runs_folder_is_refused_until_the_first_process_is_gone(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(
            RunsFolderError,
            match=f"another relay up \\(run first, pid {holder.pid}\\) is running in {tmp_path}: .*--runs-dir DIR",
        ):
            RunsLock(tmp_path).acquire("second")
        with pytest.raises(RunsFolderError, match="then resume this run"):
            RunsLock(tmp_path).acquire("second", resuming=True)
        with pytest.raises(RunsFolderError, match="run first"):  # the check before the pre-start checks
            RunsLock(tmp_path).check()
    finally:
        holder.send_signal(signal.SIGKILL)  # killed: no clean-up of its own
        holder.wait()
    assert (tmp_path / LOCK).exists()  # the file stays; the lock went with the process
    RunsLock(tmp_path).check()
    RunsLock(tmp_path / "none").check()  # no runs folder yet: nothing holds it, and nothing is written
    assert not (tmp_path / "none").exists()
    lock = RunsLock(tmp_path).acquire("second")
    assert (tmp_path / LOCK).read_text() == f"{os.getpid()} second\n"
    lock.release()


def test_the_base_model_of_a_run_given_a_folder_is_a_link_to_it(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    link_base_model(tmp_path / "run" / "learner", str(model))
    assert (tmp_path / "run" / "learner" / "base_model").resolve() == model
    link_base_model(tmp_path / "tiny-run" / "learner", "tiny")  # the learner builds that one itself
    assert not (tmp_path / "tiny-run").exists()
