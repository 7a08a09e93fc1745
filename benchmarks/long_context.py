"""long_context: how long a single sequence one learner rank trains within a fixed memory budget, without and
with Ulysses sequence parallelism (``learner.compute.sequence_parallel``, learner/sequence_parallel.py), and what
packing saves on a batch of mixed lengths.

Each measurement is a child process (``python -m benchmarks.long_context --child ...``; with sequence
parallelism 2, two ranks under ``torch.distributed.run``, gloo, one thread each): the learner's engine
(DeepSpeed ZeRO 0, fp32, torch AdamW, activation checkpointing) and update (learner/update.py) on
SmolLM2-135M-Instruct train one step on one group of one sequence of L tokens (a 16-token prompt, the rest
completion; ``micro_batch_tokens`` = ⌈L / k⌉, each rank's share; ``logprob_chunk_tokens`` 256, so that the
logits of a chunk, 256 × 49,152 floats, are the same at every length) and report the highest RSS high-water mark
(``VmHWM``) of its ranks and the step's time (AdamW's state is allocated in it, at every length alike).

- ``long_context/sp2``: the longest L that trains with every rank's peak RSS within the budget, with k = 2
  against k = 1 (target ≥ 1.8). The budget is fixed per rank: the peak of k = 1 at L = 256 (the model, its
  gradients, AdamW's state, DeepSpeed and gloo: what does not grow with L) plus ``HEADROOM_MB``. The search
  doubles L from 256 until a length exceeds the budget, then bisects ``BISECT`` times: the answer is a lower
  bound, short of the longest by less than a quarter of the last length the doubling reached.
- ``long_context/sp2_step_per_token``: seconds per token of one step at the longest length both can train, k = 2
  (two ranks on the machine's two cores) against k = 1 (one rank, one core).
- ``long_context/packing``: seconds per step of packed micro-batches (``learner.compute.packing``, attention one
  SDPA call per sample: learner/packing.py ``packed_attention``) against padded ones on a batch of mixed lengths
  (8 samples of 64 to 1,024 tokens, ``micro_batch_tokens`` 2,048; target ≤ 0.8). Its details also time the
  packed rows through SDPA with the block-diagonal mask (``packed_masked``).

The model: as learner_memory's (``$RELAY_SMOLLM2`` or ``.cache/smollm2-135m-instruct``, built when missing);
skipped, saying why, when it cannot be had. Not in ``--quick``: minutes of steps on sequences of thousands of
tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import ROOT, child_env, row, skipped

START, HEADROOM_MB, BISECT, PROMPT, CHUNK = 256, 512, 2, 16, 256
TARGET_LENGTH, TARGET_PACKING = 1.8, 0.8
MIXED = dict(samples=8, shortest=64, longest=1024, micro_batch_tokens=2048, repeats=3)


def _config(model: str, run_dir: str, **compute):
    from learner.config import LearnerConfig

    cfg = LearnerConfig(run_dir=run_dir, model=model)
    cfg.optim.lr = 1e-6
    for k, v in compute.items():
        setattr(cfg.compute, k, v)
    return cfg


def child_length(model: str, length: int, sp: int) -> dict:
    """One step on one sequence of ``length`` tokens split over ``sp`` ranks: the ranks' highest peak RSS (AdamW's
    state allocated in it, as in every later step) and its time."""
    import torch
    import torch.distributed as dist

    from benchmarks.learner import make_groups
    from benchmarks.learner_memory import peak_rss_mb
    from learner.engine import init_distributed
    from learner.policy import build_policy
    from learner.update import PolicyUpdate

    torch.manual_seed(0)
    rank, world = init_distributed()
    run_dir = tempfile.mkdtemp(prefix="relay-bench-lc-")
    per_rank = -(-length // sp)
    cfg = _config(
        model,
        run_dir,
        micro_batch_tokens=per_rank,
        gradient_checkpointing=True,
        sequence_parallel=sp,
        logprob_chunk_tokens=CHUNK,
    )
    policy = build_policy(cfg, rank == 0)
    vocab = policy.vocab
    completion = length - PROMPT
    groups = make_groups(
        1, 1, completion, seed=0, vocab=vocab, prompt_tokens=PROMPT - 2, min_tokens=completion, sampling={}
    )
    update = PolicyUpdate(policy.engine, cfg, policy.pad_id, rank=rank, world=world)
    t0 = time.perf_counter()
    update.train_step(groups, groups[0].sampling, 0)
    step_s = time.perf_counter() - t0
    peak = torch.tensor([peak_rss_mb()], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"peak_rss_mb": float(peak), "step_s": step_s, "length": length, "sp": sp, "ranks": world}


def child_packing(model: str) -> dict:
    """Padded and packed micro-batches of one mixed batch, alternating: their step times."""
    from benchmarks.learner import make_groups
    from learner.engine import build_engine, load_model
    from learner.packing import use_packed_attention
    from learner.update import PolicyUpdate

    cfg = _config(
        model,
        tempfile.mkdtemp(prefix="relay-bench-lc-"),
        micro_batch_tokens=MIXED["micro_batch_tokens"],
        gradient_checkpointing=True,
        shared_prompt=False,
    )
    net, tok = load_model(cfg)
    groups = make_groups(
        2,
        MIXED["samples"] // 2,
        MIXED["longest"] - PROMPT,
        seed=0,
        vocab=net.get_input_embeddings().num_embeddings,
        prompt_tokens=PROMPT - 2,
        min_tokens=MIXED["shortest"] - PROMPT,
        sampling={},
    )
    update = PolicyUpdate(build_engine(net, cfg), cfg, tok.pad_token_id or 0)
    times: dict[str, list[float]] = {"padded": [], "packed": [], "packed_masked": []}
    diags = {}
    for i in range(1 + MIXED["repeats"]):
        for mode in times:
            update.forwards.packed = mode.startswith("packed")
            use_packed_attention(net, on=mode == "packed")  # the others: transformers' SDPA and its mask
            t0 = time.perf_counter()
            d = update.train_step(groups, groups[0].sampling, 0)
            if i:
                times[mode].append(time.perf_counter() - t0)
            diags[mode] = {k: d[k] for k in ("micro_batches", "padding_fraction", "forward_tokens") if k in d}
    lengths = [len(g.prompt_ids) + len(s.completion_ids) for g in groups for s in g.samples]
    return {"times": times, "diagnostics": diags, "lengths": lengths}


def _spawn(args: list[str], ranks: int = 1) -> dict:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks > 1 else []
    env = child_env()
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)  # a parent's process group: the child makes its own
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run(
        [sys.executable, *launcher, "-m", "benchmarks.long_context", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        return {"failed": res.stderr[-1500:] or f"exit code {res.returncode}"}
    return json.loads(lines[-1][len("RESULT ") :])


def _fits(model: str, length: int, sp: int, budget: float, tried: dict) -> bool:
    out = _spawn(["--child", model, str(length), str(sp)], ranks=sp)
    tried[(sp, length)] = out
    return "failed" not in out and out["peak_rss_mb"] <= budget


def longest(model: str, sp: int, budget: float, tried: dict) -> int:
    """The longest length (doubling from START, then BISECT bisections) whose step stays within ``budget``."""
    lo, hi = 0, START
    while _fits(model, hi, sp, budget, tried):
        lo, hi = hi, hi * 2
    for _ in range(BISECT if lo else 0):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(model, mid, sp, budget, tried) else (lo, mid)
    return lo


def run(quick: bool) -> list[dict]:
    from benchmarks.learner_memory import smollm2

    names = ("long_context/sp2", "long_context/sp2_step_per_token", "long_context/packing")
    if quick:
        return []  # minutes of long steps: by name or in a full run only
    found = smollm2()
    if isinstance(found, str):
        return [skipped(n, found, u, None, "lower") for n, u in zip(names, ("tokens", "s per token", "s per step"))]
    model = str(found)
    base = _spawn(["--child", model, str(START), "1"])
    if "failed" in base:
        raise RuntimeError(f"long_context: the {START}-token step failed: {base['failed']}")
    budget = base["peak_rss_mb"] + HEADROOM_MB
    tried: dict = {}
    one, two = longest(model, 1, budget, tried), longest(model, 2, budget, tried)
    both = min(one, two)
    for k in (1, 2):  # the search may not have tried the other k at this length (it bisects each k alone)
        if both and (k, both) not in tried:
            _fits(model, both, k, budget, tried)
    t1, t2 = tried.get((1, both)), tried.get((2, both))
    details = {
        "model": "SmolLM2-135M-Instruct",
        "engine": "DeepSpeed ZeRO 0, fp32, torch AdamW, activation checkpointing, one thread per rank",
        "budget_mb_per_rank": round(budget),
        "rest_mb_at_256": round(base["peak_rss_mb"]),
        "headroom_mb": HEADROOM_MB,
        "longest_sp1": one,
        "longest_sp2": two,
        "tried": [{"sp": k[0], "length": k[1], **v} for k, v in sorted(tried.items())],
    }
    rows = [row("long_context/sp2", float(two), float(max(one, 1)), "tokens", TARGET_LENGTH, "higher", details)]
    if t1 and t2 and "failed" not in t1 and "failed" not in t2:
        rows.append(
            row(
                "long_context/sp2_step_per_token",
                t2["step_s"] / both,
                t1["step_s"] / both,
                "s per token",
                None,
                "lower",
                {"length": both, "sp1_step_s": t1["step_s"], "sp2_step_s": t2["step_s"]},
            )
        )
    pack = _spawn(["--packing", model])
    if "failed" in pack:
        raise RuntimeError(f"long_context/packing failed: {pack['failed']}")
    med = {m: statistics.median(t) for m, t in pack["times"].items()}
    rows.append(
        row(
            "long_context/packing",
            med["packed"],
            med["padded"],
            "s per step",
            TARGET_PACKING,
            "lower",
            {
                **MIXED,
                "lengths": pack["lengths"],
                "times": pack["times"],
                "diagnostics": pack["diagnostics"],
                "packed_vs_packed_masked": med["packed"] / med["packed_masked"],
            },
        )
    )
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs=3, metavar=("MODEL", "LENGTH", "SP"))
    p.add_argument("--packing", metavar="MODEL")
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    if a.child:
        out = child_length(a.child[0], int(a.child[1]), int(a.child[2]))
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(out), flush=True)
        from learner.engine import close_distributed

        close_distributed()
    else:
        print("RESULT " + json.dumps(child_packing(a.packing)), flush=True)
