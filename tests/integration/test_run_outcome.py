"""How `relay up` records a run: `runs/latest` moves only to a run that started (its learner published
a version), `summary.json` says how the run ended (`status`, `error`), and the run's config files hold
what the environment set (below the flags)."""

import json

import pytest

from tests.support.services import child_env, relay


@pytest.mark.slow  # two runs of every service (~40 s)
def test_latest_moves_only_to_runs_that_started_and_the_summary_says_how_each_ended(tmp_path):
    runs = tmp_path / "runs"
    common = [
        "--runs-dir",
        str(runs),
        "--dashboard-port",
        "0",
        "--no-progress",
        "--generators",
        "1",
        "--set",
        "learner.batch.groups=4",
        "--set",
        "broker.eval.every_versions=0",
    ]
    env = {**child_env(), "RELAY_STEPS": "9", "RELAY_SAMPLING__TEMPERATURE": "0.9", "RELAY_AUTH_TOKEN": "tok-5f3a"}
    res = relay("up", "--run-id", "good", "--steps", "2", *common, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads((runs / "good" / "summary.json").read_text())
    assert s["status"] == "completed" and s["error"] is None and s["steps"] == 2  # the flag over RELAY_STEPS
    assert (runs / "latest").resolve() == (runs / "good").resolve()
    # the environment is in the run's config files, and `relay config show` prints them
    assert json.loads((runs / "good" / "config" / "learner.json").read_text())["steps"] == 2
    assert json.loads((runs / "good" / "config" / "generator-0.json").read_text())["sampling"]["temperature"] == 0.9
    # the reward service's token (from the environment) reached it and the generators, but no file
    assert s["audit"]["trained_once"] >= 8 and s["audit"]["lost"] == 0
    assert not any("tok-5f3a" in f.read_text() for f in (runs / "good" / "config").iterdir())
    shown = relay("config", "show", "latest", "--runs-dir", str(runs))
    assert shown.returncode == 0 and '"temperature": 0.9' in shown.stdout and '"keep_versions": 4' in shown.stdout

    # a start that fails (the learner cannot create its folder): runs/latest stays on the run that worked
    res = relay(
        "up",
        "--run-id",
        "bad",
        "--no-restart",
        "--set",
        "learner.run_dir=/proc/relay-no-such-dir",
        *common,
        timeout=300,
    )
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads((runs / "bad" / "summary.json").read_text())
    assert s["status"] == "failed" and "learner" in s["error"], s
    assert (runs / "latest").resolve() == (runs / "good").resolve()
