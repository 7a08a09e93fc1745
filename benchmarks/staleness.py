"""The staleness experiment (docs/off-policy.md): the same task, seed and budget with generators
forced to lag (admission η = 3: samples up to 4 versions old), for each correction mode.

    .venv/bin/python -m benchmarks.staleness --steps 300 --out runs/staleness

Writes one run per mode under --out and prints a Markdown table of the final reward and the
off-policy diagnostics (means over the last 10% of steps)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MODES = {
    "none": ["--set", "learner.correction.mode=none"],
    "tis": ["--set", "learner.correction.mode=tis", "--set", "learner.correction.tis_cap=2.0"],
    "decoupled": ["--set", "learner.correction.mode=decoupled", "--set", "learner.correction.tis_cap=null"],
}


def run(steps: int, out: Path, seed: int, eta: int) -> list[dict]:
    rows = []
    for mode, extra in MODES.items():
        cmd = [sys.executable, "-m", "deploy.cli", "up", "--steps", str(steps), "--seed", str(seed),
               "--runs-dir", str(out), "--run-id", mode, "--dashboard-port", "0", "--no-progress",
               "--set", f"learner.admission_eta={eta}", "--set", "learner.max_staleness=8",
               "--set", "learner.minibatches=2", *extra]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        s = json.loads((out / mode / "summary.json").read_text())
        metrics = [json.loads(x) for x in (out / mode / "learner" / "metrics.jsonl").read_text().splitlines()]
        tail = metrics[-max(1, len(metrics) // 10):]
        stale: dict[str, int] = {}
        for m in metrics:
            for k, v in m["staleness"].items():
                stale[k] = stale.get(k, 0) + v
        mean = lambda key: sum(m[key] for m in tail) / len(tail)  # noqa: E731
        rows.append({"mode": mode, "reward_first": s["reward_first"], "reward_last": s["reward_last"],
                     "ess": mean("ess"), "frac_truncated": mean("frac_truncated"), "frac_clipped": mean("frac_clipped"),
                     "mismatch_kl": mean("mismatch_kl"), "staleness": dict(sorted(stale.items(), key=lambda kv: int(kv[0]))),
                     "dropped_stale": s["groups_dropped_stale"]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--out", default="runs/staleness")
    a = p.parse_args()
    rows = run(a.steps, Path(a.out), a.seed, a.eta)
    print("| mode | reward first 10% | reward last 10% | ESS | truncated | clipped | mismatch KL | staleness (versions: samples) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['mode']}` | {r['reward_first']:.3f} | {r['reward_last']:.3f} | {r['ess']:.3f} | "
              f"{r['frac_truncated']:.3f} | {r['frac_clipped']:.3f} | {r['mismatch_kl']:.4f} | {r['staleness']} |")
    Path(a.out, "table.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
