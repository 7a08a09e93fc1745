"""`relay up --resume RUN`: a run stopped with Ctrl-C, resumed, then crashed (its `relay up` killed
with SIGKILL), continues to its configured steps in the same run folder, with every group trained
exactly once over all three parts; `relay status RUN` then shows the finished run's report. Both
commands as the README shows them, in a scratch working folder. The broker runs two ingest workers."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.services import ROOT, child_env, relay

STEPS, BATCH = 80, 4


@pytest.mark.slow  # three parts of a run of every service (~45 s)
def test_ctrl_c_then_resume_trains_every_group_once_to_the_configured_steps(tmp_path):
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
            "r",
            "--steps",
            str(STEPS),
            "--generators",
            "1",
            "--dashboard-port",
            "0",
            "--no-progress",
            "--set",
            f"learner.batch.groups={BATCH}",
            "--set",
            "learner.publish.checkpoint_every=7",
            "--set",
            "broker.eval.every_versions=0",
            # two ingest workers: the generator spreads its groups over both, and exactly-once
            # holds across them, a crash and the resumes (which may move their ports)
            "--set",
            "broker.ingest_workers=2",
        ],
        cwd=work,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = runs / "r"
    metrics = run / "learner" / "metrics.jsonl"
    _wait(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 3, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    first = json.loads((run / "summary.json").read_text())
    assert first["status"] == "interrupted" and 0 < first["steps"] < STEPS, first  # stopped mid-run
    assert first["audit"]["lost"] == 0 and first["audit"]["trained_twice"] == 0, first["audit"]
    # the summary was written after every service stopped (in dependency order, the learner last): its steps are
    # the learner's last, and the learner did not lose Redis under its feet
    assert first["steps"] == json.loads(metrics.read_text().splitlines()[-1])["step"], first
    assert "ConnectionError" not in (run / "logs" / "learner.log").read_text()
    # the final version exported on Ctrl-C too, and the exact command that resumes the run
    assert first["export"]["version"] == first["versions_published"] and (run / "export" / "config.json").is_file()
    m = re.search(r"resume with: (.+)", out)  # as relay up was run here: python -m deploy.cli
    assert m and m.group(1) == f"{sys.executable} -m deploy.cli up --resume runs/r", out
    assert "interrupted: " in out and "{" not in out, out  # the report, not summary.json

    # resumed, then crashed: relay up killed outright (its children get SIGTERM from the kernel)
    crash = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "up", "--resume", "runs/r", "--dashboard-port", "0", "--no-progress"],
        cwd=work,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait(lambda: metrics.read_text().count("\n") >= first["steps"] + 5, crash)
    crash.kill()
    crash.wait()
    pids = json.loads((run / "pids.json").read_text()).values()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"  # part 1's: nothing since

    block = re.search(
        r"for a finished run or one that was stopped:\s*```\n(.*?)```", (ROOT / "README.md").read_text(), re.S
    )
    assert block, "README lost its resume commands"
    status, resume = [c for c in block.group(1).splitlines() if c]
    assert resume == ".venv/bin/relay up --resume runs/latest" and status == ".venv/bin/relay status runs/latest"
    resumed = _sh(resume + " --dashboard-port 0 --no-progress", work)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "completed" and s["steps"] == STEPS and s["resumes"] >= 1, s
    # the learner continued from the checkpoint it wrote when stopped, not from the initial weights, twice
    log = (run / "logs" / "learner.log").read_text()
    assert f"resumed from checkpoint at step {first['steps']}" in log and log.count("resumed from checkpoint") >= 2
    a = s["audit"]  # over the three parts
    assert a["trained_once"] == STEPS * BATCH == s["groups_trained"], a
    assert a["trained_twice"] == 0 and a["lost"] == 0, a
    assert len((run / "learner" / "metrics.jsonl").read_text().splitlines()) == STEPS
    assert s["export"]["version"] == s["versions_published"] > first["versions_published"]
    assert (runs / "latest").resolve() == run.resolve()

    # a finished run: its report, from the folder; resuming it again is refused
    shown = _sh(status, work)
    assert shown.returncode == 0, shown.stderr
    assert f"run r completed: {STEPS}/{STEPS} steps" in shown.stdout and "lost 0, trained twice 0" in shown.stdout
    again = relay("up", "--resume", str(run), "--no-progress")
    assert again.returncode == 2 and "nothing to resume" in again.stderr, again.stderr

    # the same secrets served all three parts, and no file of the run folder but secrets/ holds one
    # (the configs carry the Redis URLs redacted; the services got them in their environment)
    secrets = [f.read_text().strip() for f in (run / "secrets" / "redis").glob("*.password")]
    secrets.append((run / "secrets" / "announce.key").read_text().strip())
    assert len(secrets) == 5 and all(len(x) >= 32 for x in secrets)
    assert json.loads((run / "config" / "learner.json").read_text())["redis_url"].startswith("redis://learner:***@")
    for f in run.rglob("*"):
        if f.is_file() and f.relative_to(run).parts[0] != "secrets":
            data = f.read_bytes()
            assert not any(x.encode() in data for x in secrets), f"a secret in {f}"


@pytest.mark.slow  # two parts of a run of every service, two generators (~60 s)
def test_a_two_generator_run_stopped_and_resumed_rejects_no_group_and_publishes_each_version_once(tmp_path):
    """Ctrl-C mid-run, then the resume command relay up printed, typed as printed: every generator sends
    with its own ingest key again (before, generator 1 got generator 0's and the broker refused all its
    groups), and the versions go on by one from where they stood (before, the resumed learner published
    its checkpoint's weights again under a new number: a run resumed once ended one version past its
    steps)."""
    steps = 30
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.executable).parent.parent)  # the README's .venv/bin/relay
    run = work / "runs" / "r"
    metrics = run / "learner" / "metrics.jsonl"
    proc = subprocess.Popen(
        [
            ".venv/bin/relay",
            "up",
            "--run-id",
            "r",
            "--steps",
            str(steps),
            "--generators",
            "2",
            "--dashboard-port",
            "0",
            "--no-progress",
            "--set",
            f"learner.batch.groups={BATCH}",
            "--set",
            "learner.publish.checkpoint_every=7",
            "--set",
            "broker.eval.every_versions=0",
        ],
        cwd=work,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 8, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    first = json.loads((run / "summary.json").read_text())
    assert first["status"] == "interrupted" and 8 <= first["steps"] < steps, first
    assert first["versions_published"] == first["steps"] and first["groups_rejected"] == 0, first
    # the command that resumes it, as it can be typed from here: relay was run as .venv/bin/relay
    m = re.search(r"resume with: (.+)", out)
    assert m and m.group(1) == ".venv/bin/relay up --resume runs/r", out

    resumed = _sh(m.group(1) + " --dashboard-port 0 --no-progress", work)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "completed" and s["steps"] == steps and s["resumes"] == 1, s
    keys = {json.loads((run / "config" / f"generator-{i}.json").read_text())["ingest_key_file"] for i in range(2)}
    assert keys == {str(run.resolve() / "secrets" / "ingest" / f"generator-gen-{i}.key_secret") for i in range(2)}
    assert s["groups_rejected"] == 0 and s["audit"]["rejected"] == 0, (s["groups_rejected"], s["audit"])
    assert s["audit"]["trained_once"] == steps * BATCH and s["audit"]["lost"] == 0, s["audit"]
    # both generators of the second part sent groups, from the version the run stood at onwards
    for gid, g in s["generators"].items():
        assert g["groups_sent"] > 0 and g["version_applied"] > first["versions_published"], (gid, g)
    # one version per step, from the initial one: no version published twice, none skipped
    assert s["versions_published"] == s["export"]["version"] == steps, s
    versions = [json.loads(ln)["version"] for ln in metrics.read_text().splitlines()]
    assert versions == list(range(1, steps + 1)), versions
    log = (run / "logs" / "learner.log").read_text()
    assert log.count("published initial version 0;") == 1, log[-3000:]
    assert f"continuing from announced version {first['versions_published']};" in log, log[-3000:]


def _sh(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=300)


def _wait(cond, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"relay up exited early with code {proc.returncode}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
