"""async_speedup: the asynchronous promise end to end. Wall time until the default job (the copy task,
the tiny model, 2 generators, 32 groups a step) reaches a mean reward of 0.8, synchronous (admission
η = 0: generate a batch, then train on it) against asynchronous (η = 1 and η = 2: the next batches are
generated while the learner trains, with the off-policy correction of the learner's config on, by
default truncated importance sampling), with 3 seeds each, all in one run, the modes interleaved seed
by seed so that all of them see the same machine.

The generators run the torch backend with ``step_latency_s`` added to every decode step: a stand-in
for a GPU engine, whose generation costs time but not this machine's two cores (which the learner
needs). The latency is chosen so that generating a learner batch takes about as long as training on
it here, the case where asynchrony can at best halve the time.

A run ends at the first step where the mean reward of its last ``WINDOW`` trained groups reaches the
target (``learner.target.reward``); the time counted runs from the end of the learner's first step to
the end of that step, so the start-up (DeepSpeed, the services, the generators' first batch), the
same in every mode, is left out. The row's value is the median over
seeds of the asynchronous times, its baseline the synchronous median; the ratio is their quotient (at
most 1/1.5 is the target: 1.5× faster), and ``details`` has every run, the speed-up per seed and its
spread.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, child_env, row, staleness_histogram

TARGET_SPEEDUP = 1.5
WINDOW = 128  # groups in the moving mean (4 steps of 32)
# Each generator samples its 16 prompts of a step in one batch (prompts_per_batch) whose 8 decode steps
# each wait STEP_LATENCY_S, and the learner makes 2 passes over each batch (ppo_epochs): measured on
# this machine, a synchronous step then spends ~0.35 s waiting for generation and ~0.35 s training.
# Two passes, not the default one, because generation still costs this machine some CPU (sampling the
# tiny model, scoring, sending: ~0.12 s a step) that a GPU engine would not; a longer training step
# leaves most of generation's time to the latency.
# The learning rate is 5e-4, not the tiny model's default (2e-3 when this was measured, 1e-3 now): at 2e-3 every step moves the policy so far that
# a sample one version older is worth much less, and two runs of this benchmark there measured η = 1 at
# 1.64x and then 0.68x synchronous (docs/benchmarks.md; docs/off-policy.md's staleness experiment found
# the same).
STEP_LATENCY_S = 0.022
SETTINGS = {"generator.prompts_per_batch": 16, "learner.optim.ppo_epochs": 2, "learner.optim.lr": 5e-4}


def one_run(runs: Path, eta: int, seed: int, target: float, max_steps: int) -> dict:
    run_id = f"eta{eta}-seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "up",
        "--steps",
        str(max_steps),
        "--generators",
        "2",
        "--seed",
        str(seed),
        "--runs-dir",
        str(runs),
        "--run-id",
        run_id,
        "--dashboard-port",
        "0",
        "--no-progress",
        "--set",
        f"generator.backend.step_latency_s={STEP_LATENCY_S}",
        *[a for k, v in SETTINGS.items() for a in ("--set", f"{k}={v}")],
        "--set",
        f"learner.batch.admission_eta={eta}",
        "--set",
        f"learner.target.reward={target}",
        "--set",
        f"learner.target.window={WINDOW}",
        # no evaluation rounds: not what this measures, and relay up would wait for the last one
        "--set",
        "broker.eval.every_versions=0",
    ]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=3600)
    wall = time.time() - t0
    if res.returncode != 0:
        raise RuntimeError(f"relay up ({run_id}) failed with {res.returncode}:\n{res.stderr[-3000:]}")
    metrics = [
        json.loads(x) for x in (runs / run_id / "learner" / "metrics.jsonl").read_text().splitlines() if x.strip()
    ]
    from learner.config import LearnerConfig  # the run's learner config with every default filled in

    config = LearnerConfig.model_validate(json.loads((runs / run_id / "config" / "learner.json").read_text()))
    first, last = metrics[0], metrics[-1]
    start = first["t"]  # after the start-up and the first batch, the same in every mode
    # the moving mean that ended the run, recomputed from the groups' rewards
    rewards = [r for m in metrics for r in m["group_rewards"]]
    reached = len(rewards) >= WINDOW and statistics.fmean(rewards[-WINDOW:]) >= target
    steps = len(metrics)
    return {
        "eta": eta,
        "seed": seed,
        "reached": reached,
        "seconds": last["t"] - start,
        "steps": steps,
        "s_per_step": (last["t"] - start) / max(1, steps - 1),
        "wall_s": round(wall, 1),
        "wait_s_mean": statistics.fmean(m["wait_s"] for m in metrics),
        "compute_s_mean": statistics.fmean(m["compute_s"] for m in metrics),
        "final_window_reward": statistics.fmean(rewards[-WINDOW:]) if rewards else None,
        "correction": config.correction.model_dump(),
        "ppo_epochs": config.optim.ppo_epochs,
        "staleness": staleness_histogram(metrics),
    }


def run(quick: bool) -> list[dict]:
    # --quick (make test's smoke run): one seed, a low target, the pipeline end to end (~1.5 min)
    seeds, etas, target, max_steps = ((0,), (0, 1), 0.2, 300) if quick else ((0, 1, 2), (0, 1, 2), 0.8, 600)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="relay-bench-async-") as tmp:
        for seed in seeds:  # the modes interleaved: each seed's runs back to back
            for eta in etas:
                r = one_run(Path(tmp), eta, seed, target, max_steps)
                print(
                    f"relay bench: async_speedup: η={eta} seed={seed}: "
                    + (
                        f"reward {target} in {r['seconds']:.1f} s, {r['steps']} steps"
                        if r["reached"]
                        else f"reward {target} not reached in {r['steps']} steps"
                    ),
                    file=sys.stderr,
                    flush=True,
                )
                runs.append(r)
    # a run that never reached the target counts with its whole length (a lower bound), and fails the row
    secs = {eta: [r["seconds"] for r in runs if r["eta"] == eta] for eta in etas}
    sync = statistics.median(secs[0])
    out = []
    for eta in etas[1:]:
        value = statistics.median(secs[eta])
        per_seed = [s / a for s, a in zip(secs[0], secs[eta])]
        out.append(
            row(
                f"async_speedup/eta{eta}",
                value,
                sync,
                f"s to mean reward {target}",
                1 / TARGET_SPEEDUP,
                "lower",
                {
                    "speedup_of_medians": sync / value,
                    "speedup_per_seed": per_seed,
                    "speedup_spread": [min(per_seed), max(per_seed)],
                    "target_speedup": TARGET_SPEEDUP,
                    "target_reward": target,
                    "window_groups": WINDOW,
                    "step_latency_s": STEP_LATENCY_S,
                    "settings": SETTINGS,
                    "correction": runs[0]["correction"],
                    "seeds": list(seeds),
                    "runs": [r for r in runs if r["eta"] in (0, eta)],
                },
                extra_ok=all(r["reached"] for r in runs if r["eta"] in (0, eta)),
            )
        )
    return out
