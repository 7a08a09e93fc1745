"""``relay bench``: every stage of Relay measured against its raw baseline in the same run.

    relay bench                         # all, full size (~26 minutes; docs/benchmarks.md)
    relay bench --quick --json out.json # tiny sizes, seconds (make test runs this as a smoke test)
    relay bench ingest learner          # some of them
    relay bench peer                    # Relay against TRL's GRPOTrainer (by name only: hours)

Each benchmark returns rows ``{name, value, baseline, ratio, target, better, unit, met, details}``
(or ``skipped`` with the reason); ``ratio`` is value / baseline and ``target`` bounds it. A benchmark
never fails on time: a missed target is reported, not raised. A benchmark that breaks is reported
with its error and makes the command exit 1.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

# name -> (module, what it measures); modules are imported only when run
BENCHMARKS = {
    "codec": "encode + decode of a group (8 × 1,024 tokens) vs numpy tobytes/frombuffer",
    "ingest": "2 producers -> ZeroMQ -> broker -> Redis stream -> consumer vs pipelined XADD/XREADGROUP",
    "ingest_scaling": "groups/s with 1, 2, 4, 8 producers through 1 and 2 broker ingest workers vs raw XADD "
    "with the same producers",
    "weight_sync": "publish -> applied on 2 generators per transport (Qwen2.5-0.5B's shape, bf16) vs its raw "
    "baseline; the learner's blocked time per publication",
    "fanout": "publish -> applied on all of 1, 2, 4 and 8 receivers per transport (Qwen2.5-0.5B's shape, bf16; "
    "lightweight receivers): seconds per added receiver, fitted, vs the latency with one",
    "overlap": "async over sync speed-up vs the ideal, learner idle fraction (simulated-latency generators)",
    "async_speedup": "wall time to a mean reward of 0.8 on the default task, asynchronous (η = 1, 2) vs synchronous "
    "(η = 0), 3 seeds each (torch generators with a latency per decode step)",
    "generator": "tokens/s of a generator service vs its raw engine (torch, vLLM)",
    "learner": "s per optimizer step of the learner vs a plain PyTorch loop",
    "learner_memory": "peak RSS of one learner step at 4N vs N tokens (SmolLM2-135M, fixed micro_batch_tokens); "
    "step time vs a plain PyTorch loop doing the same micro-batched work",
    "learner_forwards": "s per learner step with each group's prompt computed once (shared_prompt) and with packed "
    "micro-batches vs every sample whole (SmolLM2-135M, the demo's shapes)",
    "long_context": "the longest single sequence one learner rank trains within a fixed RSS budget with Ulysses "
    "sequence parallelism 2 vs 1, step time per token at a length both train, packing vs padding on mixed lengths "
    "(SmolLM2-135M, fp32, activation checkpointing; not in --quick)",
    "peer": "Relay (torch and vLLM generators) against Hugging Face TRL's GRPOTrainer on the SmolLM2 word problems: "
    "wall time to N steps and to pass@1 0.9, pass@1 at equal steps, trained tokens/s (needs the peer extra; "
    "hours: run by name only)",
}
WITH_VLLM = ("generator",)
# run only when named: neither --quick nor a plain `relay bench` includes them
BY_NAME_ONLY = ("peer",)


def _fmt(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores_usable']} cores, {m['memory_gb']} GB; Python {m['python']}, "
        f"torch {m['versions']['torch']}, redis-server {m['versions']['redis-server']}"
        + (f", vLLM {m['versions']['vllm']}" if m["versions"].get("vllm") else "")
        + f"; commit {m['commit']}; {'quick' if report['quick'] else 'full'} size, {report['wall_s']:.0f} s.",
        "",
        "| benchmark | unit | value | raw baseline | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["benchmarks"]:
        target = "–" if r["target"] is None else ("≥ " if r["better"] == "higher" else "≤ ") + _fmt(r["target"])
        if r.get("skipped") or r.get("error"):
            why = f"skipped: {r['skipped']}" if r.get("skipped") else f"error: {r['error'].splitlines()[0]}"
            lines.append(f"| {r['name']} | {r['unit']} | {why} | | | {target} | |")
            continue
        met = {True: "yes", False: "**no**", None: "–"}[r["met"]]
        lines.append(
            f"| {r['name']} | {r['unit']} | {_fmt(r['value'])} | {_fmt(r['baseline'])} | "
            f"{_fmt(r['ratio'])} | {target} | {met} |"
        )
    return "\n".join(lines) + "\n"


def run(names: list[str], quick: bool, vllm: bool | None = None, sglang: bool = False) -> dict:
    """Run ``names`` (all when empty). vLLM rows run unless ``quick``, or when ``vllm`` is True; the SGLang
    row only when ``sglang``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions")
    )
    from benchmarks.common import machine, torch_threads

    include_vllm = (not quick) if vllm is None else vllm
    t0 = time.time()
    report = {
        "schema": 1,
        "command": "relay bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None,
        "quick": quick,
        "started_at": t0,
        "machine": machine(),
        "benchmarks": [],
    }
    for name in names or [n for n in BENCHMARKS if n not in BY_NAME_ONLY]:
        print(f"relay bench: {name} ...", file=sys.stderr, flush=True)
        t = time.time()
        try:
            mod = importlib.import_module(f"benchmarks.{name}")
            with torch_threads(1):
                rows = mod.run(quick, include_vllm, sglang) if name in WITH_VLLM else mod.run(quick)
        except Exception as e:  # reported in the table and the JSON, and the command exits 1
            rows = [
                {
                    "name": name,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                    "value": None,
                    "baseline": None,
                    "ratio": None,
                    "target": None,
                    "better": None,
                    "unit": "",
                    "met": None,
                    "details": {},
                }
            ]
        for r in rows:
            r["wall_s"] = round(time.time() - t, 2)
            status = (
                r.get("skipped")
                and f"skipped ({r['skipped']})"
                or r.get("error")
                or f"{_fmt(r['value'])} vs {_fmt(r['baseline'])} {r['unit']}: ratio {_fmt(r['ratio'])}"
            )
            print(f"relay bench: {r['name']}: {status}", file=sys.stderr, flush=True)
        report["benchmarks"].extend(rows)
    report["wall_s"] = time.time() - t0
    return report


def main(
    names: list[str], quick: bool, json_path: str | None, md_path: str | None, vllm: bool | None, sglang: bool = False
) -> int:
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(
            f"relay bench: unknown benchmark(s) {', '.join(unknown)}; valid: {', '.join(BENCHMARKS)}", file=sys.stderr
        )
        return 2
    report = run(names, quick, vllm, sglang)
    table = markdown(report)
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1, allow_nan=False, default=str))
    if md_path:
        Path(md_path).write_text(table)
    return 1 if any(r.get("error") for r in report["benchmarks"]) else 0
