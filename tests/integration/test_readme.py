"""Every command the README shows, run as shown (at tiny size)."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.services import ROOT, child_env

README = (ROOT / "README.md").read_text()


def _block_after(marker: str) -> str:
    m = re.search(re.escape(marker) + r".*?```(?:\w+)?\n(.*?)```", README, re.S)
    assert m, f"README lost the block after {marker!r}"
    return m.group(1)


def _run(cmd: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout)


def test_quick_start_is_exactly_make_run_and_make_test():
    assert _block_after("## Quick start").split() == ["make", "run", "make", "test"]


def test_every_relay_command_the_readme_shows_is_typed_one_way():
    """`make` puts `relay` in .venv/bin, not on PATH: every command line of the README's code blocks is
    typed `.venv/bin/relay ...`, never a bare `relay ...` that the shell would not find."""
    lines = [ln.strip() for block in re.findall(r"```(?:\w+)?\n(.*?)```", README, re.S) for ln in block.splitlines()]
    typed = [ln for ln in lines if re.match(r"(\S*/)?relay\s+[a-z]+(\s|$)", ln)]  # not the output "relay up: ..."
    assert len(typed) >= 10 and all(ln.startswith(".venv/bin/relay ") for ln in typed), typed


@pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)
def test_configuration_examples_run_as_shown(tmp_path):
    """The README's `relay up` and `make run` lines, in a scratch copy of the working folder."""
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(ROOT / ".venv")
    (work / "Makefile").symlink_to(ROOT / "Makefile")
    (work / "pyproject.toml").symlink_to(ROOT / "pyproject.toml")
    toml = _block_after("where `my-run.toml` is, for example:")
    (work / "my-run.toml").write_text(toml)
    commands = [c for c in _block_after("## Configuration").splitlines() if c.strip()]
    assert len(commands) == 3
    # the second (the last run's model) twice: it works from a run that was itself given --model (before, that
    # run's folder had no learner/base_model and the command failed the second time)
    assert "--model runs/latest/learner/base_model" in commands[1]
    for cmd in [commands[0], commands[1], commands[1], commands[2]]:
        res = _run(cmd + (" --dashboard-port 0 --no-progress" if "relay up" in cmd else ""), work)
        assert res.returncode == 0, f"{cmd}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        summary = json.loads((work / "runs" / "latest" / "summary.json").read_text())
        assert summary["steps"] == 20, (cmd, summary)
        if "--generators 3" in cmd:
            assert len(summary["generators"]) == 3


@pytest.mark.slow  # a real 135M-parameter model through every service: ~2-3 min
def test_the_smollm2_demo_runs_as_shown_at_small_size(tmp_path):
    """`make smollm2-demo` as the README shows it, made small with RELAY_ARGS (1 step of 1 group
    of 4, 2 eval questions): the model folder, the data, the example config and the real model through
    every service. The learning itself is measured by the full run (examples/smollm2-cpu/README.md)."""
    cmd = _block_after("## A real language model on a laptop").strip()
    assert cmd == "make smollm2-demo"
    work = tmp_path / "work"
    work.mkdir()
    (ROOT / ".cache").mkdir(exist_ok=True)  # shared: the model folder is built once
    for name in (".venv", ".cache", "Makefile", "pyproject.toml", "examples", "tests"):
        (work / name).symlink_to(ROOT / name)
    small = (
        "--steps 1 --set learner.batch.groups=1 --set generator.prompts_per_batch=1 "
        "--set generator.sampling.n=4 --set broker.eval.prompts=2 --dashboard-port 0 --no-progress"
    )
    res = _run(f'{cmd} RELAY_ARGS="{small}"', work, timeout=900)
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    summary = json.loads((work / "runs" / "latest" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["export"], summary
    rounds = {r["version"]: r for r in summary["eval"]}
    assert {0, 1} <= set(rounds) and all(r["n_prompts"] == 2 and r["reward_failures"] == 0 for r in rounds.values())
    assert (work / ".cache" / "smollm2-demo" / "test.jsonl").read_text().count("\n") == 128


def test_the_layout_table_has_one_line_per_folder_of_the_tree():
    table = README.split("## Layout", 1)[1]
    listed = re.findall(r"^\| `([\w/]+)/` \|", table, re.M)
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    packages = {
        str(Path(f).parent) for f in tracked.split() if f.endswith("__init__.py") and not f.startswith("tests/")
    }
    assert len(listed) == len(set(listed)), "a folder listed twice"
    assert packages | {"tests"} <= set(listed), (
        f"folders missing from the README's layout table: {packages - set(listed)}"
    )
    assert all((ROOT / f).is_dir() for f in listed), "a folder in the table that does not exist"


def test_the_progress_capture_has_the_lines_relay_up_prints():
    """The README's progress capture: each line is one `progress_line` would print for that state
    (deploy/launcher/progress.py), from waiting for the first version to a running step."""
    from deploy.launcher.progress import progress_line

    capture = _block_after("While it runs, the progress line").splitlines()
    assert len(capture) >= 3
    assert all(re.match(r"step \d+/\d+  elapsed \S+  ", ln) for ln in capture), capture
    assert "waiting for the learner's first version" in capture[0]
    last = capture[-1]
    m = re.search(
        r"step (\d+)/(\d+)  elapsed (\S+)  eta \S+  ([\d.]+) steps/s  (\d+) tok/s  reward ([\d.]+)  "
        r"loss (\S+)  len (\d+)/(\d+) cut (\d+)%  eval pass@1 ([\d.]+) \(v(\d+)\)  queue (\d+)  gen-0",
        last,
    )
    assert m, last
    step, total = int(m[1]), int(m[2])
    st = {
        "learner": {
            "step": step,
            "reward_mean": float(m[6]),
            "loss": float(m[7]),
            "completion_len_mean": float(m[8]),
            "completion_len_max": float(m[9]),
            "completion_truncated_frac": int(m[10]) / 100,
        },
        "learner_version": step,
        "queue_depth": int(m[13]),
        "generators": [
            {"id": g.split(":v")[0], "version": int(g.split(":v")[1])} for g in last.split("  ")[-1].split()
        ],
    }
    mins, secs = re.fullmatch(r"(?:(\d+)m)?(\d+)s", m[3]).groups()
    elapsed = int(mins or 0) * 60 + int(secs)
    steps_s = float(m[4])
    printed = progress_line(st, total, elapsed, steps_s, float(m[5]), {"version": int(m[12]), "pass@1": float(m[11])})
    assert printed.split("  eta ")[0] == last.split("  eta ")[0]
    assert printed.split(" tok/s  ")[1] == last.split(" tok/s  ")[1]


def test_the_end_of_run_capture_has_the_reports_lines():
    """The README's terminal capture of a run's end is what `relay up` prints (deploy/launcher/report.py)."""
    from deploy.launcher.report import format_report

    capture = _block_after("A run ends with a short report").splitlines()
    assert re.fullmatch(r"relay up: run \S+ completed: 600/600 steps in \d+m\d\ds", capture[0]), capture[0]
    labels = [ln.split()[0] for ln in capture[1:]]
    summary = {
        "status": "completed",
        "run_id": "x",
        "steps": 600,
        "steps_total": 600,
        "reward_first": 0.1,
        "reward_last": 0.9,
        "eval": [{"version": 0, "pass@1": 0.0}],
        "groups_trained": 1,
        "audit": {},
        "export": {"path": "p", "version": 600},
    }
    assert labels == [ln.split()[0] for ln in format_report(summary, Path("runs/x")).splitlines()[1:]]


def test_the_failure_captures_are_what_relay_up_prints():
    """The README's captures of a run whose reward plugin raises: the progress line is what `progress_line`
    prints for that state, and the report's lines are `format_report`'s for that summary."""
    from deploy.launcher.progress import progress_line
    from deploy.launcher.report import format_report

    warning, line = _block_after("What fails after start-up is said as it starts").splitlines()
    assert warning.startswith("relay up: warning: reward plugin 'raises' failed 264 samples: plugin_error: ")
    st = {
        "learner": {"groups_dropped_reward_failed": 704},
        "learner_version": 0,
        "queue_depth": 0,
        "generators": [{"id": "gen-0", "version": 0, "reward_ok": 0}],
        "failures": {"reward_failures": 5128, "reward_failures_by_plugin": {"raises": 5128}},
    }
    assert progress_line(st, 20, 47.0, None, None, {"version": 0, "pass@1": 0.0}) == line
    capture = _block_after("What went wrong on the way has lines of its own").splitlines()
    reason = "plugin_error: ValueError: the test plugin's own bug"
    summary = {
        "status": "failed",
        "run_id": "raise3",
        "steps": 0,
        "steps_total": 20,
        "wall_seconds": 86.0,
        "reward_first": None,
        "reward_last": None,
        "eval": [{"version": 0, "pass@1": 0.0}],
        "groups_trained": 0,
        "groups_dropped_stale": 0,
        "groups_dropped": {"reward_failed": 3488},
        "groups_rejected": 0,
        "audit": {"lost": 0, "trained_twice": 0},
        "reward_failures": {
            "samples": 28032,
            "samples_scored": 0,
            "by_plugin": {"raises": 28032},
            "last_reason": {"raises": reason},
        },
        "warnings": [warning.removeprefix("relay up: warning: ")],
        "error": capture[-1].removeprefix("relay up: error: "),
    }
    assert format_report(summary, Path("runs/raise3")).splitlines() == capture[:-1]
