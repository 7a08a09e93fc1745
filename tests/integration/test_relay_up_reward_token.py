"""`relay up` makes a reward token per run: the run's generators score with it (the learner trains), while
a request to the reward service's /score without it, or with another, is answered 401."""

from __future__ import annotations

import re
import signal
import stat
import subprocess
import sys
import threading

import httpx
import pytest

from deploy.launcher.run_tokens import reward_token_path
from tests.support.services import ROOT, child_env, wait_until

pytestmark = pytest.mark.slow  # a run of several services: left to `make test` (docs/testing.md)

ITEM = {"items": [{"prompt": "1 2 3", "completion": "1 2 3", "reference": "123", "task": "copy"}]}


def test_the_reward_service_of_a_run_answers_only_with_the_run_s_token(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "up",
            "--steps",
            "5000",
            "--dashboard-port",
            "0",
            "--runs-dir",
            str(tmp_path),
            "--run-id",
            "tok",
            "--no-progress",
            "--set",
            "learner.batch.groups=2",
            "--set",
            "generator.prompts_per_batch=2",
            "--set",
            "generator.sampling.n=2",
        ],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
    try:
        m = wait_until(
            lambda: re.search(r"reward service at (http://127\.0\.0\.1:\d+) \(.*secrets/reward\.token", "".join(lines)),
            120,
            "the reward service's URL",
        )
        url = m.group(1)
        dash = re.search(r"dashboard at (http://127\.0\.0\.1:\d+/)", "".join(lines)).group(1)

        # the generators send the token: their groups are scored and trained on
        def stepped():
            if proc.poll() is not None:
                raise AssertionError(f"relay up exited ({proc.returncode}):\n{''.join(lines)}")
            try:
                return httpx.get(dash + "api/state", timeout=10).json()["learner"].get("step", 0) >= 1
            except httpx.HTTPError:  # the broker's HTTP server not up yet
                return False

        wait_until(stepped, 300, "a learner step")
        state = httpx.get(dash + "api/state", timeout=10).json()
        assert state["failures"]["reward_failures"] == 0, state["failures"]
        path = reward_token_path(tmp_path / "tok")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text().strip()
        assert len(token) >= 43
        assert httpx.post(f"{url}/score", json=ITEM, timeout=10).status_code == 401
        assert (
            httpx.post(f"{url}/score", json=ITEM, headers={"Authorization": "Bearer guess"}, timeout=10).status_code
            == 401
        )
        ok = httpx.post(f"{url}/score", json=ITEM, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["results"][0]["status"] == "ok"
        # the token is nowhere in the run's config files or its logs
        for f in [*(tmp_path / "tok" / "config").iterdir(), *(tmp_path / "tok" / "logs").iterdir()]:
            assert token not in f.read_text(errors="replace"), f
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
