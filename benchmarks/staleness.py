"""The staleness experiment (docs/off-policy.md): the same task and budget with generators forced to
lag (admission η = 3: samples up to 4 versions old), for each correction mode and estimator, over
several seeds.

    .venv/bin/python -m benchmarks.staleness --steps 300 --seeds 0 1 2 --out runs/staleness

Writes one run per mode and seed under --out (``<mode>-s<seed>``; a run already finished there is
read, not run again, so an interrupted experiment continues) and prints a Markdown table: per mode,
the mean and the spread (min–max) over the seeds of the final reward, and the means of the
off-policy diagnostics (each run's mean over its last 10% of steps)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MODES = {
    "none": ["--set", "learner.correction.mode=none"],
    "tis": ["--set", "learner.correction.mode=tis", "--set", "learner.correction.tis_cap=2.0"],
    "decoupled": ["--set", "learner.correction.mode=decoupled", "--set", "learner.correction.tis_cap=null"],
    # the critic's estimators (issue 19): V-trace's own truncated ratios (ρ̄ = c̄ = 1) from the behaviour
    # log-probs, no correction on top; GAE with the same TIS as the `tis` row
    "vtrace": [
        "--set",
        "learner.advantages.estimator=vtrace",
        "--set",
        "learner.critic.enabled=true",
        "--set",
        "learner.correction.mode=none",
    ],
    "gae+tis": [
        "--set",
        "learner.advantages.estimator=gae",
        "--set",
        "learner.critic.enabled=true",
        "--set",
        "learner.correction.mode=tis",
        "--set",
        "learner.correction.tis_cap=2.0",
    ],
}


def one_run(mode: str, seed: int, steps: int, out: Path, eta: int, lr: float) -> dict:
    """Run (or read, when it already finished under ``out``) one mode at one seed; its figures."""
    run_id = f"{mode.replace('+', '_')}-s{seed}"
    folder = out / run_id
    if not (folder / "summary.json").exists():
        if folder.exists():
            raise SystemExit(f"{folder} holds an unfinished run; delete it to run it again")
        cmd = [
            sys.executable,
            "-m",
            "deploy.cli",
            "up",
            "--steps",
            str(steps),
            "--seed",
            str(seed),
            "--runs-dir",
            str(out),
            "--run-id",
            run_id,
            "--dashboard-port",
            "0",
            "--no-progress",
            "--set",
            f"learner.batch.admission_eta={eta}",
            "--set",
            "learner.batch.max_staleness=8",
            "--set",
            "learner.optim.minibatches=2",
            "--set",
            "broker.eval.every_versions=0",
            "--set",
            f"learner.optim.lr={lr}",
            *MODES[mode],
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    s = json.loads((folder / "summary.json").read_text())
    metrics = [json.loads(x) for x in (folder / "learner" / "metrics.jsonl").read_text().splitlines()]
    tail = metrics[-max(1, len(metrics) // 10) :]
    stale: dict[str, int] = {}
    for m in metrics:
        for k, v in m["staleness"].items():
            stale[k] = stale.get(k, 0) + v
    mean = lambda key: sum(m[key] for m in tail) / len(tail)  # noqa: E731
    rewards = [m["reward_mean"] for m in metrics]
    # the first step whose 10-step mean reward reached 0.9 (None: never): how fast, where the final reward saturates
    reached = next((i + 1 for i in range(9, len(rewards)) if sum(rewards[i - 9 : i + 1]) / 10 >= 0.9), None)
    return {
        "mode": mode,
        "seed": seed,
        "reached_0_9_at": reached,
        "reward_first": s["reward_first"],
        "reward_last": s["reward_last"],
        "ess": mean("ess"),
        "frac_truncated": mean("frac_truncated"),
        "frac_clipped": mean("frac_clipped"),
        "mismatch_kl": mean("mismatch_kl"),
        "staleness": dict(sorted(stale.items(), key=lambda kv: int(kv[0]))),
        "dropped_stale": s["groups_dropped_stale"],
    }


def run(steps: int, out: Path, seeds: list[int], eta: int, modes: list[str], lr: float) -> list[dict]:
    return [one_run(mode, seed, steps, out, eta, lr) for seed in seeds for mode in modes]


def table(runs: list[dict], modes: list[str]) -> list[str]:
    """One Markdown row per mode: reward mean and min–max over the seeds, diagnostics' means."""
    lines = [
        "| mode | seeds | reward first 10% | reward last 10%: mean (min–max) | ≥ 0.9 at step: each seed | ESS | "
        "truncated | clipped | mismatch KL | samples ≥ 3 versions old |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        avg = lambda key: statistics.fmean(r[key] for r in rs)  # noqa: E731
        last = [r["reward_last"] for r in rs]
        old = sum(n for r in rs for k, n in r["staleness"].items() if int(k) >= 3)
        total = sum(n for r in rs for n in r["staleness"].values())
        lines.append(
            f"| `{mode}` | {len(rs)} | {avg('reward_first'):.3f} | {statistics.fmean(last):.3f} "
            f"({min(last):.3f}–{max(last):.3f}) | "
            f"{', '.join(str(r['reached_0_9_at'] or '—') for r in rs)} | {avg('ess'):.3f} | {avg('frac_truncated'):.3f} | "
            f"{avg('frac_clipped'):.3f} | {avg('mismatch_kl'):.4f} | {old / max(total, 1):.0%} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--eta", type=int, default=3)
    p.add_argument(
        "--lr",
        type=float,
        default=5e-4,
        help="one learning rate for every mode (the tiny model's "
        "default with a critic; 2e-3, the tiny model's GRPO default until 6 December 2026, drifts on stale samples even corrected)",
    )
    p.add_argument("--out", default="runs/staleness")
    a = p.parse_args()
    out = Path(a.out)
    runs = run(a.steps, out, a.seeds, a.eta, a.modes, a.lr)
    print("\n".join(table(runs, a.modes)))
    (out / "table.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
