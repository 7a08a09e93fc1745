"""learner_forwards: what the learner's two ways of cutting a batch into forwards save, against computing
every sample whole (its micro-batches padded to their longest sample: what a plain loop does).

- ``learner_forwards/shared_prompt`` (``learner.compute.shared_prompt``, on by default): each group's prompt
  computed once for its n samples (one forward fills a KV cache that the group's completions continue
  from): P + n·C tokens of work instead of n·(P + C).
- ``learner_forwards/packing`` (``learner.compute.packing``): each micro-batch's samples in one row without
  padding (learner/packing.py), attention one SDPA call per sample (``relay_packed``, what the learner uses with
  packing); its details also time the same packed rows through transformers' SDPA with the block-diagonal mask
  (``packing_masked``: every query against every key of the row), to show what the per-sample calls save.

One learner (DeepSpeed engine, torch AdamW, learner/update.py ``PolicyUpdate.train_step``) trains the same
batch in the four modes in turn, step after step (``Forwards.shared`` / ``Forwards.packed`` and the model's
attention switched between steps), so that all see the same machine load; each row is the median seconds per optimizer
step of its mode against the whole rows'. All three compute the same log-probs and gradients (to 1e-5 in
fp32: tests/unit/learner/test_shared_prompt.py, test_packing.py).

The batch has the SmolLM2 demo's shapes (examples/smollm2-cpu: a ~90-token prompt, its system prompt and
question, 8 completions of 16 to 64 tokens per question) on SmolLM2-135M-Instruct in fp32, run in a child
process with the example learner's two threads. ``--quick``: the built-in tiny model, a few tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import ROOT, child_env, row, skipped

TARGET = 1.0  # either mode must not be slower than whole rows
MODES = ("whole", "shared_prompt", "packing", "packing_masked")
FULL = dict(groups=4, n=8, prompt=90, completion=64, min_completion=16, micro_batch_tokens=2048, repeats=3)
QUICK = dict(groups=2, n=4, prompt=8, completion=8, min_completion=2, micro_batch_tokens=64, repeats=2)
THREADS = 2  # examples/smollm2-cpu/relay.toml's learner.compute.threads


def child(model: str, size: dict) -> dict:
    """The three modes' step times on one learner, alternating (the first round is a warm-up)."""
    import torch

    from benchmarks.learner import make_groups
    from learner.config import LearnerConfig
    from learner.engine import build_engine, load_model
    from learner.packing import use_packed_attention
    from learner.update import PolicyUpdate

    torch.manual_seed(0)
    cfg = LearnerConfig(run_dir=tempfile.mkdtemp(prefix="relay-bench-lf-"), model=model, lr=1e-6)
    cfg.compute.micro_batch_tokens = size["micro_batch_tokens"]
    net, tok = load_model(cfg)
    vocab = net.get_input_embeddings().num_embeddings
    groups = make_groups(
        size["groups"],
        size["n"],
        size["completion"],
        seed=0,
        vocab=vocab,
        prompt_tokens=size["prompt"] - 2,
        min_tokens=size["min_completion"],
        sampling={"temperature": 0.7},
    )
    update = PolicyUpdate(build_engine(net, cfg), cfg, tok.pad_token_id or 0)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    diags: dict[str, dict] = {}
    for i in range(1 + size["repeats"]):
        for mode in MODES:
            update.forwards.shared, update.forwards.packed = mode == "shared_prompt", mode.startswith("packing")
            use_packed_attention(net, on=mode == "packing")  # the others: transformers' SDPA and its mask
            t0 = time.perf_counter()
            d = update.train_step(groups, groups[0].sampling, 0)
            if i:  # the first round warms up: the optimizer's state, the allocator
                times[mode].append(time.perf_counter() - t0)
            diags[mode] = {k: d[k] for k in ("micro_batches", "padding_fraction") if k in d}
    samples = [s for g in groups for s in g.samples]
    return {
        "times": times,
        "diagnostics": diags,
        "prompt_tokens": int(sum(len(g.prompt_ids) for g in groups)),
        "completion_tokens": int(sum(len(s.completion_ids) for s in samples)),
        "samples": len(samples),
        "params": sum(p.numel() for p in net.parameters()),
    }


def run(quick: bool) -> list[dict]:
    from benchmarks.learner_memory import smollm2

    size = QUICK if quick else FULL
    names = ("learner_forwards/shared_prompt", "learner_forwards/packing")
    if quick:
        model = "tiny"
    else:
        found = smollm2()
        if isinstance(found, str):
            return [skipped(n, found, "s per step", TARGET, "lower") for n in names]
        model = str(found)
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.learner_forwards", "--child", model, json.dumps(size)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=3600,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"learner_forwards child failed: {res.stderr[-2000:]}")
    out = json.loads(lines[-1][len("RESULT ") :])
    whole = statistics.median(out["times"]["whole"])
    details = {
        "model": "tiny" if quick else "SmolLM2-135M-Instruct",
        "params": out["params"],
        "groups": size["groups"],
        "samples": out["samples"],
        "prompt_tokens_per_group": size["prompt"],
        "completion_tokens": out["completion_tokens"],
        "micro_batch_tokens": size["micro_batch_tokens"],
        "engine": "DeepSpeed ZeRO 0, fp32, torch AdamW",
        "threads": THREADS,
        "steps_timed": size["repeats"],
        "whole_s_all": out["times"]["whole"],
        "whole": out["diagnostics"]["whole"],
    }
    masked = out["times"]["packing_masked"]
    extra = {  # the packed rows through SDPA with the block-diagonal mask: what the per-sample calls save
        "packing": {"packing_masked_s_all": masked, "packing_masked_vs_whole": statistics.median(masked) / whole},
    }
    return [
        row(
            name,
            statistics.median(out["times"][mode]),
            whole,
            "s per step",
            TARGET,
            "lower",
            {**details, f"{mode}_s_all": out["times"][mode], mode: out["diagnostics"][mode], **extra.get(mode, {})},
        )
        for name, mode in zip(names, MODES[1:])
    ]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs=2, metavar=("MODEL", "SIZE_JSON"), required=True)
    a = p.parse_args()
    import torch

    torch.set_num_threads(THREADS)
    print("RESULT " + json.dumps(child(a.child[0], json.loads(a.child[1]))), flush=True)
