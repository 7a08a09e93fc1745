"""Failures after start-up reach `relay up`'s console, on real runs at tiny size (docs/deploy.md, docs/rewards.md):

- a reward plugin that raises (installed as a user installs one: a package with a `relay.rewards` entry
  point, tests/support/failing_plugins.py) is named with its error on the console within 30 s of the
  learner's first version, stops the run once no reward has been scored for --fail-after seconds, and
  is in the final report and summary.json; it once meant minutes of "waiting for the first batch" and
  a report saying "0 dropped stale";
- an environment whose episodes all fail is named with its error and stops the run the same way;
- a wrong reward token stops the run at once with the setting to fix as its last line; it once held
  every batch as a reward outage (0 steps in 55 s, nothing said).
"""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from tests.support.failing_plugins import ENV_MESSAGE, MESSAGE, install
from tests.support.services import ROOT, child_env

pytestmark = pytest.mark.slow  # a whole `relay up` each (~40-60 s)

COMMON = ["--generators", "1", "--steps", "20", "--dashboard-port", "0", "--no-progress"]


class Console:
    """`relay up` as a child whose output lines are read as they come, each with the time it arrived."""

    def __init__(self, args: list[str], env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "up", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, ln) for t, ln in self.lines if re.search(pattern, ln)), None)

    def text(self) -> str:
        return "\n".join(ln for _, ln in self.lines)

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self.reader.join(10)
        return rc


def test_a_raising_reward_plugin_is_named_on_the_console_within_30s_and_in_the_report(tmp_path):
    env = {**child_env(), "PYTHONPATH": os.pathsep.join([install(tmp_path / "plugins"), str(ROOT)])}
    runs = tmp_path / "runs"
    up = Console(
        [
            *COMMON,
            "--runs-dir",
            str(runs),
            "--run-id",
            "boom",
            "--fail-after",
            "30",
            "--set",
            "reward.task_plugins.copy=raises",
        ],
        env,
    )
    try:
        deadline = time.monotonic() + 300
        while not (runs / "latest").exists():  # the learner published its first version: generation starts
            assert up.proc.poll() is None and time.monotonic() < deadline, up.text()
            time.sleep(0.1)
        ready = time.monotonic()
        while (said := up.first(r"relay up: warning: reward plugin 'raises' failed")) is None:
            assert time.monotonic() - ready < 30, f"not named within 30 s of the first version:\n{up.text()}"
            assert up.proc.poll() is None, up.text()
            time.sleep(0.1)
        assert said[0] - ready < 30 and f"plugin_error: ValueError: {MESSAGE}" in said[1], said
        assert str(runs / "boom" / "logs" / "reward.log") in said[1]  # where to look
        rc = up.wait(300)  # no reward scored for --fail-after 30 s: the run stops with that reason
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
    out = up.text()
    assert rc == 1, out
    last = out.splitlines()[-1]
    assert last.startswith("relay up: error: no reward was scored for ") and "reward plugin 'raises'" in last, last
    assert MESSAGE in last
    summary = json.loads((runs / "boom" / "summary.json").read_text())
    rf = summary["reward_failures"]
    assert summary["status"] == "failed" and "reward plugin 'raises'" in summary["error"]
    assert rf["by_plugin"]["raises"] == rf["samples"] > 0 and rf["samples_scored"] == 0
    assert rf["last_reason"]["raises"] == f"plugin_error: ValueError: {MESSAGE}"
    assert rf["groups_dropped"] == summary["groups_dropped"]["reward_failed"] > 0  # counted though no step ran
    assert summary["warnings"] and "reward plugin 'raises'" in summary["warnings"][0]
    # the final report says it too, not "0 dropped stale" alone
    assert re.search(
        rf"  rewards      {rf['samples']} of {rf['samples']} samples failed: raises {rf['samples']} "
        rf"\(plugin_error: ValueError: {MESSAGE}\)",
        out,
    ), out
    assert re.search(r"  groups       0 trained, 0 dropped stale, \d+ dropped \(every reward failed\)", out), out


def test_a_wrong_reward_token_stops_the_run_with_the_setting_to_fix(tmp_path):
    runs = tmp_path / "runs"
    up = Console(
        [
            *COMMON,
            "--runs-dir",
            str(runs),
            "--run-id",
            "token",
            "--set",
            "reward.auth_token=the-right-one",
            "--set",
            "generator.reward_token=a-wrong-one",
        ],
        child_env(),
    )
    t0 = time.monotonic()
    rc = up.wait(300)
    out = up.text()
    assert rc == 1, out
    last = out.splitlines()[-1]
    assert (
        last.startswith("relay up: error: gen-0 failed during the run: ")
        and "refused the generator's token (HTTP 401): set generator.reward_token to its reward.auth_token" in last
    ), last
    assert "restart" not in out.split("relay up: run token failed")[0]  # not restarted: a restart cannot fix it
    summary = json.loads((runs / "token" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 0 and "exit code 2" in summary["error"]
    assert time.monotonic() - t0 < 300


def test_an_environment_that_fails_every_episode_is_named_and_stops_the_run(tmp_path):
    """A custom environment (a `relay.envs` entry point) whose episodes all fail as they start: named on the
    console with its error, and the run stops once no reward has been scored for --fail-after seconds."""
    env = {**child_env(), "PYTHONPATH": os.pathsep.join([install(tmp_path / "plugins"), str(ROOT)])}
    runs = tmp_path / "runs"
    up = Console(
        [
            *COMMON,
            "--runs-dir",
            str(runs),
            "--run-id",
            "env",
            "--fail-after",
            "30",
            "--set",
            "generator.episodes.env=fails_at_start",
            "--set",
            "learner.tiny.tools=true",
            "--set",
            "generator.episodes.max_tokens=32",
        ],
        env,
    )
    rc = up.wait(300)
    out = up.text()
    assert rc == 1, out
    said = up.first(r"relay up: warning: environment 'fails_at_start' failed \d+ episodes")
    assert said and f"env_error: exception_ValueError: {ENV_MESSAGE}" in said[1], out
    last = out.splitlines()[-1]
    assert last.startswith("relay up: error: no reward was scored for ") and "environment 'fails_at_start'" in last
    summary = json.loads((runs / "env" / "summary.json").read_text())
    assert summary["reward_failures"]["by_plugin"]["env:fails_at_start"] > 0 and summary["steps"] == 0
