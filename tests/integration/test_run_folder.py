"""`relay up`'s runs folder (deploy/launcher/rundir.py): one run at a time in a runs folder (a second
`relay up` there is refused within seconds, before anything starts, naming the fix), plain `relay status`
showing that run, the run folder private to its user (0700, no file readable by anyone else: weights,
logs, Redis's append-only file), and a runs folder that cannot be written refused before start."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.services import ROOT, child_env, relay


def _readme_status() -> str:
    """The README's plain status command (its Dashboard section)."""
    block = re.search(r"The same state in a terminal.*?```\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README lost its status commands"
    return block.group(1).splitlines()[0]


def _wait(cond, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"relay up exited early with code {proc.returncode}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)


@pytest.mark.slow  # one run of every service (~30 s)
def test_one_run_per_runs_folder_plain_status_shows_it_and_its_folder_is_private(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.executable).parent.parent)  # the README's .venv/bin/relay
    runs = work / "runs"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "up",
            "--run-id",
            "a",
            "--steps",
            "12",
            "--generators",
            "1",
            "--dashboard-port",
            "0",
            "--no-progress",
            "--set",
            "learner.batch.groups=4",
            "--set",
            "broker.eval.every_versions=0",
        ],
        cwd=work,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics = runs / "a" / "learner" / "metrics.jsonl"
        _wait(lambda: (runs / "latest").exists() and metrics.is_file() and metrics.read_text().strip(), proc)

        # a second relay up in the same runs folder: refused at once, nothing of it started or written
        t0 = time.monotonic()
        second = relay("up", "--run-id", "b", "--steps", "2", "--dashboard-port", "0", "--no-progress", cwd=work)
        took = time.monotonic() - t0
        assert second.returncode == 2 and took < 5, (second.returncode, took, second.stderr)
        assert f"another relay up (run a, pid {proc.pid}) is running in {runs.resolve()}" in second.stderr, (
            second.stderr
        )
        assert "--runs-dir DIR" in second.stderr, second.stderr
        assert not (runs / "b").exists() and (runs / "latest").resolve() == (runs / "a").resolve()

        # plain `relay status` as the README shows it, from where relay up was typed: that run, live (not
        # whatever answers at port 8080)
        assert _readme_status() == ".venv/bin/relay status"
        shown = subprocess.run(
            _readme_status(), shell=True, cwd=work, env=child_env(), capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0 and shown.stdout.startswith("run a   learner version"), shown
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]

    # the run folder and everything in it: its user's alone (the umask of every service, redis-server included)
    run = runs / "a"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    exposed = [
        f"{p.relative_to(run)} {oct(stat.S_IMODE(p.lstat().st_mode))}"
        for p in run.rglob("*")
        if not p.is_symlink() and stat.S_IMODE(p.lstat().st_mode) & 0o077
    ]
    assert not exposed, exposed
    assert any((run / "appendonlydir").iterdir()) and any((run / "weights").iterdir())  # what it must protect

    shown = subprocess.run(
        _readme_status(), shell=True, cwd=work, env=child_env(), capture_output=True, text=True, timeout=60
    )  # finished: its report
    assert shown.returncode == 0 and shown.stdout.startswith("relay up: run a completed: 12/12 steps"), shown
    # the lock went with the run: the next relay up in this folder is not refused for it
    third = relay("up", "--run-id", "a", "--dashboard-port", "0", "--no-progress", cwd=work)
    assert third.returncode == 2 and "already exists" in third.stderr, third.stderr


def _read_only_runs_dir(tmp_path):
    """A runs folder on a read-only mount (a private mount namespace: `unshare`), else, for a user other than
    root, a folder without write permission; None where neither can be made here."""
    runs = tmp_path / "ro-runs"
    runs.mkdir()
    if shutil.which("unshare") and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0:
        mount = f"mount --bind {runs} {runs} && mount -o remount,bind,ro {runs} && "
        return runs, lambda cmd: ["unshare", "-rm", "sh", "-c", mount + " ".join(cmd)], "read-only file system"
    if os.geteuid() != 0:
        runs.chmod(0o555)
        return runs, lambda cmd: cmd, "Permission denied"
    return None


def test_a_runs_folder_that_cannot_be_written_is_refused_before_start_with_the_fix(tmp_path):
    made = _read_only_runs_dir(tmp_path)
    if made is None:
        pytest.skip("no read-only folder can be made here (root without user namespaces)")
    runs, wrap, why = made
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--runs-dir", str(runs), "--dashboard-port", "0", "--no-progress"]
    res = subprocess.run(wrap(cmd), capture_output=True, text=True, env=child_env(), timeout=60)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert f"relay up: error: cannot write the run into {runs}: " in res.stderr and why in res.stderr, res.stderr
    assert "give a writable folder with --runs-dir DIR" in res.stderr and "Errno" not in res.stderr, res.stderr
    assert json.dumps(os.listdir(runs)) == "[]"
