"""peer: Relay against Hugging Face TRL's ``GRPOTrainer`` on the same job, the SmolLM2 demo
(examples/smollm2-cpu/: SmolLM2-135M-Instruct built locally, one-step addition word problems, the
``final_number`` reward), with the same work per step and one evaluator for both.

    relay bench peer                                    # the full comparison (hours on 2 cores)
    python -m benchmarks.peer --steps 4 --seeds 0 --systems relay-torch trl --precisions fp32 \\
        --eval-every 4 --json out.json --png out.png    # a short run, any subset

Each run is a process of its own, one at a time, the systems alternated seed by seed and precision by
precision (Relay torch, Relay vLLM, TRL, then the next) so that all of them see the same machine:

- Relay: ``relay up`` with examples/smollm2-cpu/relay.toml (one generator and the DeepSpeed learner,
  on-policy: the generator samples step v+1's batch with version v while the learner waits, then the
  learner trains while the generator waits, each on both cores), the settings below put over it with
  ``--set``, no evaluation rounds of its own, every version kept;
- TRL: benchmarks/peer_trl.py, GRPOTrainer in one process on both cores, generating with transformers
  and then training, a checkpoint saved every ``eval_every`` steps (its time is subtracted).

Afterwards the one evaluator (benchmarks/peer_eval.py) scores greedy pass@1 of each system's saved
weights at steps 0, eval_every, 2 eval_every, ... and the last on the held-out questions (the first 128 of
make_data.py's shuffled list, never trained on by either side).

Times are from the launch of the run's process: "to N steps" is the end of the N-th optimizer step
(start-up included: services, DeepSpeed, model loading; TRL's checkpoint saving left out); "per step"
is the mean over the steps after the first. Each side records where its steps' time goes: Relay's
learner its wait for a batch (the generator sampling it), its training compute and the time publishing
blocked it; TRL generation, scoring/preparation and training, one after the
other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, child_env, row, skipped, torch_threads

SYSTEMS = ("relay-torch", "relay-vllm", "trl")
PRECISIONS = ("fp32", "bf16")
TARGET_PASS = 0.9
HELD_OUT = 128

# The work both systems do per step and how they learn from it (docs/benchmarks.md, "Relay and TRL, side by
# side", has the table). The demo's values: 8 questions x 8 completions, 64 new tokens at temperature 0.7,
# AdamW at 2e-5 with torch's defaults, PPO-clip 0.2 without KL, token-mean loss over the whole batch.
SETTINGS = {
    "prompts_per_step": 8,
    "completions_per_prompt": 8,
    "max_tokens": 64,
    "temperature": 0.7,
    "lr": 2e-5,
    "betas": [0.9, 0.999],
    "adam_eps": 1e-8,
    "clip_eps": 0.2,
    "kl": 0.0,
    "grad_clip": 1.0,
    "aggregation": "token-mean over the batch's completion tokens (Relay token-mean, TRL loss_type='dapo')",
    "advantage": "GRPO: (r - group mean) / group std (Relay grpo eps 1e-6, TRL scale_rewards='group' eps 1e-4)",
    "optimizer_steps_per_batch": 1,
    # TRL's micro-batch (per_device_train_batch_size; gradient accumulation makes up the step): 16
    # completions, about Relay's micro_batch_tokens = 2,048 of ~120-token samples
    "trl_per_device_batch": 16,
    "trl_threads": 2,
}
EXAMPLE = ROOT / "examples" / "smollm2-cpu" / "relay.toml"
QUICK = {"prompts_per_step": 2, "completions_per_prompt": 2, "max_tokens": 8, "trl_per_device_batch": 4}


def prepare(work: Path) -> tuple[Path, Path, Path]:
    """The model folder (built once, shared with the demo) and the data: train.jsonl, test.jsonl."""
    sys.path.insert(0, str(ROOT / "examples" / "smollm2-cpu"))
    from make_data import write  # the demo's questions, its held-out set first
    from deploy.models.smollm2 import DEFAULT, build

    model = build(DEFAULT)
    train, test = write(work / "data", test=HELD_OUT)
    return model, train, test


def relay_args(s: dict, precision: str, backend: str) -> list[str]:
    sets = {
        "generator.prompts_per_batch": s["prompts_per_step"],
        "learner.batch.groups": s["prompts_per_step"],
        "generator.sampling.n": s["completions_per_prompt"],
        "generator.sampling.max_tokens": s["max_tokens"],
        "generator.sampling.temperature": s["temperature"],
        "learner.optim.lr": s["lr"],
        "learner.policy_loss": "ppo",
        "learner.clip_eps": s["clip_eps"],
        "learner.regularization.kl_coef": s["kl"],
        "learner.aggregation": "token-mean",
        "learner.advantages.estimator": "grpo",
        "learner.optim.ppo_epochs": 1,
        "learner.optim.minibatches": 1,
        "learner.optim.weight_decay": 0.0,
        "learner.deepspeed.gradient_clipping": s["grad_clip"],
        "learner.deepspeed.bf16": str(precision == "bf16").lower(),
        "generator.backend.dtype": "bfloat16" if precision == "bf16" else "float32",
    }
    # threads are the example's own (relay.toml: the learner's and the torch generator's), not set here
    args = ["--backend", backend] if backend != "torch" else []
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    for kv in s.get("relay_set", ()):  # --relay-set: an experiment's extra settings, recorded in the JSON
        args += ["--set", kv]
    return args


def relay_threads() -> dict:
    """The threads examples/smollm2-cpu/relay.toml gives Relay's learner and torch generator (for the record)."""
    import tomllib

    cfg = tomllib.loads(EXAMPLE.read_text())
    return {
        "learner": cfg["learner"]["compute"].get("threads"),
        "generator": cfg["generator"]["backend"].get("threads"),
    }


def run_relay(
    work: Path, model: Path, train: Path, test: Path, s: dict, steps: int, seed: int, precision: str, backend: str
) -> dict:
    run_id = f"relay-{backend}-{precision}-s{seed}"
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "up",
        "--model",
        str(model),
        "--config",
        str(EXAMPLE),
        "--generators",
        "1",
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--runs-dir",
        str(work / "runs"),
        "--run-id",
        run_id,
        "--dashboard-port",
        "0",
        "--no-progress",
        "--set",
        f"broker.dataset.path={train}",
        "--set",
        f"broker.eval.dataset.path={test}",
        "--set",
        "broker.eval.every_versions=0",
        "--set",
        "broker.eval.final=false",
        "--set",
        f"learner.publish.keep_versions={steps + 2}",
        "--set",
        "learner.publish.checkpoint_every=0",
        *relay_args(s, precision, backend),
    ]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=4 * 3600)
    if res.returncode != 0:
        raise RuntimeError(f"relay up ({run_id}) failed with {res.returncode}:\n{res.stderr[-3000:]}")
    folder = work / "runs" / run_id
    metrics = [json.loads(x) for x in (folder / "learner" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps_out = [
        {
            "step": m["step"],
            "t": m["t"] - t0,
            "wait_s": m["wait_s"],
            "train_s": m["compute_s"],
            "publish_s": m.get("publish_blocked_s") or 0.0,
            "tokens": m["tokens"],
            "reward_mean": m["reward_mean"],
            "version": m["version"],
            "staleness": m["staleness"],
        }
        for m in metrics
    ]
    weights = {0: folder / "weights" / "v000000"}
    for m in steps_out:
        weights[m["step"]] = folder / "weights" / f"v{m['version']:06d}"
    return {
        "system": f"relay-{backend}",
        "seed": seed,
        "precision": precision,
        "launch_to_exit_s": time.time() - t0,
        "steps": steps_out,
        "weights": weights,
        "folder": folder,
    }


def run_trl(
    work: Path, model: Path, train: Path, s: dict, steps: int, seed: int, precision: str, eval_every: int
) -> dict:
    out = work / f"trl-{precision}-s{seed}"
    spec = {
        "model": str(model),
        "train": str(train),
        "out": str(out),
        "seed": seed,
        "steps": steps,
        "precision": precision,
        "threads": s["trl_threads"],
        "save_every": eval_every,
        "settings": s,
    }
    spec_path = work / f"trl-{precision}-s{seed}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(child_env(), OMP_NUM_THREADS=str(s["trl_threads"]))
    t0 = time.time()
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer_trl", str(spec_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=4 * 3600,
    )
    if res.returncode != 0:
        raise RuntimeError(f"TRL ({out.name}) failed with {res.returncode}:\n{res.stderr[-3000:]}")
    lines = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines() if x.strip()]
    info = json.loads((out / "trl.json").read_text())
    saved = info["save0_s"]  # the evaluator's checkpoints: not TRL's work, left out of its times
    steps_out = []
    for m in lines:  # a step's end is recorded before its checkpoint is saved
        steps_out.append(
            {
                "step": m["step"],
                "t": m["t"] - t0 - saved,
                "gen_s": m["gen_s"],
                "prepare_s": m["prepare_s"],
                "train_s": m["train_s"],
                "tokens": m["tokens"],
                "save_s": m["save_s"],
            }
        )
        saved += m["save_s"]
    rewards = info.pop("rewards")
    for m, r in zip(steps_out, rewards):
        m["reward_mean"] = r
    weights = {k: out / f"step-{k}" for k in [0] + [m["step"] for m in lines] if (out / f"step-{k}").is_dir()}
    return {
        "system": "trl",
        "seed": seed,
        "precision": precision,
        "launch_to_exit_s": time.time() - t0,
        "steps": steps_out,
        "weights": weights,
        "folder": out,
        "trl": info,
    }


def evaluate(
    run: dict, test_rows: list[dict], eval_every: int, steps: int, max_tokens: int, start: dict | None = None
) -> list[dict]:
    """pass@1 at steps 0, eval_every, ... and the last, from the run's saved weights; each point with the
    wall time at which the run had those weights. Step 0 is the model every run starts from: ``start``, its
    evaluation (made once per benchmark, from the model folder itself), at time 0."""
    from benchmarks.peer_eval import pass_at_1

    at = {m["step"]: m["t"] for m in run["steps"]}
    curve = [{"step": 0, "t": 0.0, **start}] if start else []
    for k in sorted(set(range(eval_every if start else 0, steps + 1, eval_every)) | {steps}):
        folder = run["weights"].get(k)
        if folder is None or not folder.is_dir():
            raise RuntimeError(f"{run['system']} seed {run['seed']}: no saved weights for step {k} ({folder})")
        r = pass_at_1(folder, test_rows, max_tokens=max_tokens)
        curve.append({"step": k, "t": at.get(k, 0.0), **{x: r[x] for x in ("pass_at_1", "mean_tokens", "eval_s")}})
        print(
            f"relay bench: peer: {run['system']} {run['precision']} seed {run['seed']} step {k}: "
            f"pass@1 {r['pass_at_1']:.3f}",
            file=sys.stderr,
            flush=True,
        )
    return curve


def summarise(run: dict, steps: int) -> dict:
    """The run's figures: time to the last step, per step after the first, the per-step breakdown (means over
    the steps after the first), trained tokens/s, the time to pass@1 0.9."""
    st = run["steps"]
    if len(st) != steps:
        raise RuntimeError(f"{run['system']} seed {run['seed']}: {len(st)} steps recorded of {steps}")
    later = st[1:] or st
    keys = (
        ("wait_s", "train_s", "publish_s") if run["system"].startswith("relay") else ("gen_s", "prepare_s", "train_s")
    )
    span = st[-1]["t"] - st[0]["t"] if len(st) > 1 else None
    reached = next((p["t"] for p in run["curve"] if p["pass_at_1"] >= TARGET_PASS), None)
    return {
        "wall_to_last_s": st[-1]["t"],
        "first_step_s": st[0]["t"],
        "per_step_s": span / (len(st) - 1) if span else st[0]["t"],
        "breakdown": {k: statistics.fmean(m[k] for m in later) for k in keys},
        "tokens_per_s": sum(m["tokens"] for m in later) / span if span else None,
        "wall_to_pass_0_9_s": reached,
        "final_pass_at_1": run["curve"][-1]["pass_at_1"],
    }


def compare(runs: list[dict], system: str, precision: str, steps: int) -> list[dict]:
    mine = [r for r in runs if r["system"] == system and r["precision"] == precision]
    trl = [r for r in runs if r["system"] == "trl" and r["precision"] == precision]
    if not mine or not trl:
        return []
    med = lambda rs, k: statistics.median(r["summary"][k] for r in rs)  # noqa: E731
    name = f"peer/{system}/{precision}"
    seeds = sorted({r["seed"] for r in mine} & {r["seed"] for r in trl})
    by = lambda rs: {r["seed"]: r for r in rs}  # noqa: E731
    diff = [by(mine)[s]["summary"]["final_pass_at_1"] - by(trl)[s]["summary"]["final_pass_at_1"] for s in seeds]
    details = {"seeds": seeds, "steps": steps}
    out = [
        row(
            f"{name}/wall_to_{steps}_steps",
            med(mine, "wall_to_last_s"),
            med(trl, "wall_to_last_s"),
            "s",
            None,
            "lower",
            {**details, "relay_per_step_s": med(mine, "per_step_s"), "trl_per_step_s": med(trl, "per_step_s")},
        ),
        row(
            f"{name}/pass_at_1_step_{steps}",
            statistics.fmean(r["summary"]["final_pass_at_1"] for r in mine),
            statistics.fmean(r["summary"]["final_pass_at_1"] for r in trl),
            "pass@1",
            None,
            "higher",
            {
                **details,
                "relay_minus_trl_per_seed": diff,
                "relay_minus_trl_mean": statistics.fmean(diff) if diff else None,
                "relay_minus_trl_spread": [min(diff), max(diff)] if diff else None,
            },
        ),
    ]
    reach = [r["summary"]["wall_to_pass_0_9_s"] for r in mine], [r["summary"]["wall_to_pass_0_9_s"] for r in trl]
    if all(x is not None for x in reach[0] + reach[1]):
        out.append(
            row(
                f"{name}/wall_to_pass_0.9",
                statistics.median(reach[0]),
                statistics.median(reach[1]),
                "s",
                None,
                "lower",
                details,
            )
        )
    else:
        out.append(
            {
                **skipped(
                    f"{name}/wall_to_pass_0.9",
                    f"pass@1 {TARGET_PASS} not reached in {steps} steps by "
                    f"every run (Relay {reach[0]}, TRL {reach[1]})",
                    "s",
                    None,
                    "lower",
                ),
                "details": details,
            }
        )
    tps = [r["summary"]["tokens_per_s"] for r in mine], [r["summary"]["tokens_per_s"] for r in trl]
    if all(x is not None for x in tps[0] + tps[1]):
        out.append(
            row(
                f"{name}/trained_tokens_per_s",
                statistics.median(tps[0]),
                statistics.median(tps[1]),
                "completion tokens/s",
                None,
                "higher",
                details,
            )
        )
    return out


def figure(runs: list[dict], path: Path) -> Path | None:
    """pass@1 against wall time, every run, one panel per precision."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("relay bench: peer: no matplotlib (pip install -e '.[peer]'): no figure", file=sys.stderr)
        return None
    precisions = sorted({r["precision"] for r in runs})
    fig, axes = plt.subplots(1, len(precisions), figsize=(6 * len(precisions), 4), squeeze=False)
    colours = {"relay-torch": "tab:blue", "relay-vllm": "tab:green", "trl": "tab:orange"}
    for ax, prec in zip(axes[0], precisions):
        for r in (r for r in runs if r["precision"] == prec):
            xs = [p["t"] / 60 for p in r["curve"]]
            ax.plot(
                xs,
                [p["pass_at_1"] for p in r["curve"]],
                marker="o",
                color=colours[r["system"]],
                alpha=0.85,
                label=f"{r['system']} seed {r['seed']}",
            )
        ax.axhline(TARGET_PASS, color="grey", lw=0.8, ls="--")
        ax.set(
            title=f"SmolLM2-135M word problems, {prec}",
            xlabel="wall time from launch (min)",
            ylabel=f"greedy pass@1 ({HELD_OUT} held-out)",
            ylim=(0, 1),
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def compare_all(
    steps: int = 16,
    seeds=(0, 1),
    systems=SYSTEMS,
    precisions=PRECISIONS,
    eval_every: int = 4,
    settings: dict | None = None,
    work: Path | None = None,
    png: Path | None = None,
    held_out: int = HELD_OUT,
) -> dict:
    """Every run and its curve; the rows. ``work`` keeps the runs (a temporary folder otherwise)."""
    s = {**SETTINGS, "relay_threads": relay_threads(), **(settings or {})}
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="relay-bench-peer-")) if own else Path(work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        model, train, test = prepare(work)
        from benchmarks.peer_eval import pass_at_1, read_jsonl

        test_rows = read_jsonl(test, held_out)
        with torch_threads(2):  # both cores: nothing else runs meanwhile
            start = {
                x: v
                for x, v in pass_at_1(model, test_rows, max_tokens=s["max_tokens"]).items()
                if x in ("pass_at_1", "mean_tokens", "eval_s")
            }
        print(f"relay bench: peer: the initial model: pass@1 {start['pass_at_1']:.3f}", file=sys.stderr, flush=True)
        runs = []
        for seed in seeds:
            for prec in precisions:
                for system in systems:
                    print(f"relay bench: peer: {system} {prec} seed {seed}: {steps} steps", file=sys.stderr, flush=True)
                    r = (
                        run_trl(work, model, train, s, steps, seed, prec, eval_every)
                        if system == "trl"
                        else run_relay(work, model, train, test, s, steps, seed, prec, system.split("-", 1)[1])
                    )
                    with torch_threads(2):
                        r["curve"] = evaluate(r, test_rows, eval_every, steps, s["max_tokens"], start)
                    r["summary"] = summarise(r, steps)
                    # the weights (0.5 GB a version) once scored; a Relay run keeps its config, logs and metrics
                    for folder in (
                        [r["folder"] / "weights", r["folder"] / "export"] if system != "trl" else [r["folder"]]
                    ):
                        shutil.rmtree(folder, ignore_errors=True)
                    r.pop("weights"), r.pop("folder")
                    runs.append(r)
                    # every finished run on disk at once: a comparison takes hours, a crash keeps what was measured
                    (work / "runs-so-far.json").write_text(json.dumps(runs, indent=1, default=str))
        rows = [
            x
            for system in systems
            if system != "trl"
            for prec in precisions
            for x in compare(runs, system, prec, steps)
        ]
        fig = figure(runs, png) if png else None
        return {
            "settings": s,
            "steps": steps,
            "initial": start,
            "seeds": list(seeds),
            "eval_every": eval_every,
            "held_out": len(test_rows),
            "runs": runs,
            "rows": rows,
            "figure": str(fig) if fig else None,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        }
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def rows_from(runs: list[dict], png: Path | None = None) -> dict:
    """The rows (and the figure) of finished runs, as :func:`compare_all` reports them: the steps are those of
    the runs, which must agree."""
    steps = {len(r["steps"]) for r in runs}
    if len(steps) != 1:
        raise ValueError(f"the runs have different step counts: {sorted(steps)}")
    n = steps.pop()
    systems = sorted({r["system"] for r in runs} - {"trl"})
    precisions = sorted({r["precision"] for r in runs})
    rows = [x for system in systems for prec in precisions for x in compare(runs, system, prec, n)]
    fig = figure(runs, png) if png else None
    return {
        "steps": n,
        "seeds": sorted({r["seed"] for r in runs}),
        "runs": runs,
        "rows": rows,
        "figure": str(fig) if fig else None,
    }


def run(quick: bool) -> list[dict]:
    """``relay bench peer``: the full comparison (it is not part of ``--quick``, nor of a plain ``relay bench``:
    run it by name). The curves go into the first row's details and runs/bench-peer/ (JSON and PNG)."""
    out = ROOT / "runs" / "bench-peer"
    out.mkdir(parents=True, exist_ok=True)
    res = (
        compare_all(
            steps=2,
            seeds=(0,),
            systems=("relay-torch", "trl"),
            precisions=("fp32",),
            eval_every=2,
            settings=QUICK,
            held_out=8,
            png=out / "peer.png",
        )
        if quick
        else compare_all(png=out / "peer.png")
    )
    (out / "peer.json").write_text(json.dumps(res, indent=1, default=str))
    rows = res["rows"]
    if rows:
        rows[0]["details"].update(runs=res["runs"], settings=res["settings"], figure=res["figure"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description="Relay against TRL's GRPOTrainer on the SmolLM2 demo (docs/benchmarks.md)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--held-out", type=int, default=HELD_OUT)
    ap.add_argument("--quick", action="store_true", help="toy sizes (2 questions x 2 completions, 8 tokens)")
    ap.add_argument("--work", type=Path, help="keep the runs here (runs-so-far.json: every finished run)")
    ap.add_argument(
        "--relay-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra `relay up --set` for Relay's runs (experiments; recorded in the JSON's settings)",
    )
    ap.add_argument(
        "--rows-from",
        type=Path,
        nargs="+",
        metavar="RUNS_JSON",
        help="run nothing: the rows and the figure of finished runs (each work folder's runs-so-far.json), "
        "e.g. of a comparison run in parts",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path)
    a = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = {**(QUICK if a.quick else {}), **({"relay_set": a.relay_set} if a.relay_set else {})}
    if a.rows_from:
        res = rows_from([r for f in a.rows_from for r in json.loads(f.read_text())], a.png)
    else:
        res = compare_all(a.steps, a.seeds, a.systems, a.precisions, a.eval_every, settings, a.work, a.png, a.held_out)
    text = json.dumps(res, indent=1, default=str)
    if a.json:
        a.json.write_text(text)
    for r in res["rows"]:
        print(r["name"], r.get("skipped") or f"relay {r['value']:.4g} trl {r['baseline']:.4g} ratio {r['ratio']}")
    for r in res["runs"]:
        print(r["system"], r["precision"], r["seed"], json.dumps(r["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
