"""The critic in the real learner (DeepSpeed on CPU, the tiny model, a real Redis): with
``learner.advantages.estimator=gae`` and ``learner.critic.enabled=true`` the value model learns the returns of
groups whose reward is decided by the first completion token: its value loss falls and its explained
variance rises, both reported in metrics.jsonl with the value clip fraction and the mean value."""

import json
import subprocess
import sys

import pytest

from tests.support.services import ROOT, child_env

pytestmark = pytest.mark.slow  # a training loop (~30 s): left to `make test` (docs/testing.md)


def test_gae_with_the_critic_learns_the_values(redis_url, tmp_path):
    steps = 16
    res = subprocess.run(
        [sys.executable, "-m", "tests.support.learner_critic", redis_url, str(tmp_path), str(steps)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    for m in lines:
        assert {"value_loss", "explained_variance", "value_clip_frac", "values_mean"} <= m.keys()
        assert 0 <= m["value_clip_frac"] <= 1
    first, last = lines[:3], lines[-3:]
    mean = lambda ms, k: sum(m[k] for m in ms) / len(ms)  # noqa: E731
    assert mean(last, "value_loss") < 0.5 * mean(first, "value_loss")
    assert mean(first, "explained_variance") < 0.1 < 0.3 < mean(last, "explained_variance")
