"""The prepared GPU measurement (benchmarks/gpu_learner.py) runs end to end at its CPU size: groups
sampled by the torch backend, trained by the learner (DeepSpeed bf16, ZeRO-2, activation
checkpointing, micro-batches) and by the plain loop, figures written as strict JSON."""

import json
import math
import sys

import pytest

from tests.support.services import ROOT, child_env

pytestmark = pytest.mark.slow


def test_gpu_learner_script_runs_on_cpu_at_tiny_size(tmp_path):
    import subprocess

    out = tmp_path / "gpu.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_learner",
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--steps",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    r = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert r["device"] == "cpu" and r["params"] > 0 and r["generated_tokens"] > 0
    for side in ("learner", "plain"):
        assert r[side]["tokens_per_s"] > 0 and r[side]["peak_memory_gb"] > 0 and r[side]["mfu"] is None
    assert r["learner_diag"]["micro_batches"] > 1 and math.isfinite(r["learner_diag"]["loss"])
    assert r["ratio_tokens_per_s"] > 0
