"""docs/agents.md's "Before you start", as a new user follows it: the package layout and `pyproject.toml` it
shows, with its guess-the-number environment, installed with pip; then its `relay up` command trains with
the environment found through the package's entry point, on the tiny model (`learner.tiny.tools`). The
hints `higher` / `lower` are not in the tiny vocabulary: the run counts them as unspellable replies and
the generator's log says what the model read instead.

Test-only differences: pip installs into a folder put on PYTHONPATH (`--target`, offline: no build
isolation, no dependencies) instead of the shared virtual environment, and `relay up` gets a few steps, a
runs folder and no evaluation rounds. About 100 s of CPU (6 minutes of wall time on a busy 2-core machine)."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support.services import ROOT, child_env

pytestmark = pytest.mark.slow

DOC = (ROOT / "docs" / "agents.md").read_text()


def block(lang: str, first_line: str) -> str:
    m = re.search(rf"```{lang}\n( *{re.escape(first_line)}\n.*?)```", DOC, re.S)
    assert m, f"docs/agents.md has no {lang} block starting {first_line!r}"
    lines = m.group(1).splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    return "\n".join(line[indent:] for line in lines) + "\n"


def test_the_documented_package_installs_and_relay_up_trains_with_it(tmp_path):
    (tmp_path / "my_envs" / "my_envs").mkdir(parents=True)
    (tmp_path / "my_envs" / "pyproject.toml").write_text(block("toml", "# my_envs/pyproject.toml"))
    (tmp_path / "my_envs" / "my_envs" / "__init__.py").write_text("")
    (tmp_path / "my_envs" / "my_envs" / "guess.py").write_text(block("python", "# my_envs/my_envs/guess.py"))
    commands = re.search(r"```\n( *\.venv/bin/pip install .*?)```", DOC, re.S).group(1).split("\n")
    pip, up = (c.strip() for c in commands[:2])
    assert pip == ".venv/bin/pip install ./my_envs" and up.startswith(".venv/bin/relay up ")

    site = tmp_path / "site"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            *pip.split()[2:],
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            "--quiet",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    (dist,) = site.glob("my_envs-*.dist-info")
    assert "guess = my_envs.guess:Guess" in (dist / "entry_points.txt").read_text()

    env = {**child_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            *up.split()[1:],
            "--steps",
            "2",
            "--generators",
            "1",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--run-id",
            "guess",
            "--dashboard-port",
            "0",
            "--no-progress",
            "--set",
            "broker.eval.every_versions=0",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = tmp_path / "runs" / "guess"
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 2 and s["episodes"]["episodes"] > 0, s
    # every episode that did not guess at once was told "higher" or "lower": nothing the tiny model can read
    assert 0 < s["episodes"]["unspellable_replies"] <= s["episodes"]["turns"] - s["episodes"]["episodes"] + 1e-9
    log = (run / "logs" / "gen-0.log").read_text()
    assert re.search(r"the guess environment replied '(higher|lower)', which the model's tokenizer cannot spell", log)
