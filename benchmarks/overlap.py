"""overlap: how much of the ideal speed-up of asynchronous training over synchronous training the whole
system achieves, and the learner's idle fraction when asynchronous.

Two real runs of ``relay up`` (redis-server, broker, reward service, 2 generators, the DeepSpeed
learner on the tiny model), whose generators use the ``simulated`` backend: an engine that sleeps
``per_token_latency_s`` per generated token, standing in for a GPU engine so that generation costs
time but no CPU, as on a GPU machine.

- synchronous: admission η = 0, generators admit a batch's prompts only once the learner has
  consumed the previous batch: generate, then train, then generate. Its steps measure the two
  phases separately: T_gen = the learner's wait for a batch, T_train = the rest of its step
  (training, publication, bookkeeping).
- asynchronous: η = 1, generators sample the next batch while the learner trains.

ideal = (T_gen + T_train) / max(T_gen, T_train); value = synchronous step time / asynchronous step
time; the target is value ≥ 0.9 × ideal with the learner idle (waiting for data) at most 10 points above
its ideal idle fraction, max(0, 1 − T_train / T_gen): when generation is the slower side the learner
must wait for it even with perfect overlap, so a bare "idle ≤ 10%" would fail a perfect system.
Step times are means over the steps after the first 20% (start-up excluded).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, child_env, row, staleness_histogram

TARGET = 0.9
IDLE_TARGET = 0.10


def one_run(runs: Path, mode: str, eta: int, steps: int, latency: float, batch_groups: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "up",
        "--steps",
        str(steps),
        "--generators",
        "2",
        "--runs-dir",
        str(runs),
        "--run-id",
        mode,
        "--dashboard-port",
        "0",
        "--no-progress",
        "--set",
        "generator.backend.type=simulated",
        "--set",
        f"generator.backend.per_token_latency_s={latency}",
        "--set",
        f"generator.prompts_per_batch={batch_groups // 2}",
        "--set",
        f"learner.batch.groups={batch_groups}",
        "--set",
        f"learner.batch.admission_eta={eta}",
        "--set",
        "learner.batch.max_staleness=8",
        # no evaluation rounds: they are not what this measures, and relay up would wait for the last one
        "--set",
        "broker.eval.every_versions=0",
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"relay up ({mode}) failed with {res.returncode}:\n{res.stderr[-3000:]}")
    metrics = [json.loads(x) for x in (runs / mode / "learner" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if len(metrics) != steps:
        raise RuntimeError(f"relay up ({mode}) recorded {len(metrics)} of {steps} steps")
    skip = max(1, steps // 5)
    tail = metrics[skip:]
    step_s = [b["t"] - a["t"] for a, b in zip(metrics[skip - 1 :], tail)]
    wait = [m["wait_s"] for m in tail]
    total = sum(step_s)
    return {
        "step_s": total / len(step_s),
        "wait_s": sum(wait) / len(wait),
        "idle_fraction": sum(wait) / total,
        "compute_s": statistics.mean(m["compute_s"] for m in tail),
        "publish_blocked_s": statistics.mean(m["publish_blocked_s"] for m in tail),
        "steps_timed": len(step_s),
        "staleness": staleness_histogram(tail),
    }


def run(quick: bool) -> list[dict]:
    # tokens per generator batch: prompts_per_batch (4) x n (8) x max_tokens (8) = 256; the latency is
    # chosen so that generating a batch takes about as long as training on it here
    steps, batch_groups, latency = (5, 8, 0.0002) if quick else (60, 8, 0.0002)
    with tempfile.TemporaryDirectory(prefix="relay-bench-overlap-") as tmp:
        sync = one_run(Path(tmp), "sync", 0, steps, latency, batch_groups)
        asyn = one_run(Path(tmp), "async", 1, steps, latency, batch_groups)
    t_gen = sync["wait_s"]
    t_train = sync["step_s"] - sync["wait_s"]
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    speedup = sync["step_s"] / asyn["step_s"]
    idle = asyn["idle_fraction"]
    ideal_idle = max(0.0, 1.0 - t_train / t_gen) if t_gen > 0 else 0.0  # waiting for a slower generation is expected
    idle_ok = idle <= ideal_idle + IDLE_TARGET
    return [
        row(
            "overlap",
            speedup,
            ideal,
            "× speed-up async/sync",
            TARGET,
            "higher",
            {
                "T_gen_s": t_gen,
                "T_train_s": t_train,
                "ideal_speedup": ideal,
                "learner_idle_fraction_async": idle,
                "ideal_idle_fraction": ideal_idle,
                "idle_target": f"≤ ideal idle + {IDLE_TARGET}",
                "idle_met": idle_ok,
                "per_token_latency_s": latency,
                "batch_groups": batch_groups,
                "steps": steps,
                "sync": sync,
                "async": asyn,
            },
            extra_ok=idle_ok,
        )
    ]
