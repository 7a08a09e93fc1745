"""The learner on a GPU: tokens/s, peak GPU memory and MFU of the real learner update against a plain
PyTorch loop doing the same work. A prepared script for a lent GPU machine (see docs/benchmarks.md);
it also runs on CPU at a tiny size, which is how it is tested.

    python -m benchmarks.gpu_learner --out gpu.json                           # CUDA, ~0.5B, bf16, ZeRO-2
    python -m benchmarks.gpu_learner --device cpu --size tiny --out t.json    # the CPU check (seconds)

What it does: builds a random-init Qwen2 of ~0.5B parameters (Qwen2.5-0.5B's shape: hidden 896,
24 layers, 14 heads, 2 KV heads, vocabulary 151,936, tied embeddings; ``--size tiny``: the built-in
tiny model), samples groups with the generators' ``torch`` backend on the device (KV cache, behaviour
log-probs of the sampling transform), then trains them with the learner's DeepSpeed engine (bf16,
ZeRO-2, torch AdamW) and update (learner/update.py: micro-batches, chunked log-probs, TIS-corrected
PPO loss), and with a plain loop on a copy of the same weights: the same micro-batches, the full
logits through the same sampling transform, a policy-gradient loss, bf16 autocast, clipping, AdamW.
Steps alternate; each figure is the median of ``--steps`` timed steps after one warm-up each.

tokens/s counts prompt + completion tokens trained per second; MFU = 6 · parameters · tokens/s /
peak FLOP/s (``--peak-tflops``, default 989: an H200's dense bf16), attention FLOPs left out, so it
is a lower bound; not computed on CPU. Peak memory: ``torch.cuda.max_memory_allocated`` per phase
(reset before each), or the process's RSS high-water mark on CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

SIZES = {
    # model shape, prompts × samples per step, prompt tokens, completion tokens, micro-batch tokens
    "0.5b": dict(
        model=dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
        ),
        prompts=16,
        n=8,
        prompt=128,
        completion=512,
        micro_batch_tokens=16384,
        gradient_checkpointing=True,
    ),
    # Qwen2.5-1.5B's shape (tied embeddings as there): how memory and speed scale from 0.5B
    "1.5b": dict(
        model=dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
        ),
        prompts=16,
        n=8,
        prompt=128,
        completion=512,
        micro_batch_tokens=16384,
        gradient_checkpointing=True,
    ),
    "tiny": dict(
        model=None, prompts=4, n=4, prompt=4, completion=8, micro_batch_tokens=64, gradient_checkpointing=True
    ),
}
SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=0)


def build_model(out: Path, shape: dict | None) -> Path:
    """A random-init Qwen2 of ``shape`` with the tiny model's tokenizer (prompts of digits), or the tiny model."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.tiny_model import build_tiny_model, build_tokenizer

    if shape is None:
        return build_tiny_model(out)
    config = Qwen2Config(
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out


def sample_groups(path: Path, device: str, size: dict):
    """Groups sampled by the generators' torch backend on ``device`` (as a generator would send them)."""
    import numpy as np

    from broker.protocol.group import Group, Sample, decode_group, encode_group
    from generators.backends.torch import TorchBackend
    from generators.config import SamplingConfig, TorchBackendConfig

    backend = TorchBackend(TorchBackendConfig(device=device, dtype="bfloat16"))
    backend.load(str(path))
    sampling = SamplingConfig(n=size["n"], max_tokens=size["completion"], **SAMPLING)
    rng = np.random.default_rng(0)
    prompts = [[1, *rng.integers(3, 13, size["prompt"] - 2).tolist(), 14] for _ in range(size["prompts"])]
    t0 = time.perf_counter()
    out = backend.generate(prompts, sampling, seed=0)
    gen_s = time.perf_counter() - t0
    groups = []
    for prompt, completions in zip(prompts, out):
        samples = [
            Sample(
                np.array(c.token_ids, np.int32),
                np.array(c.logprobs, np.float32),
                [[0, len(c.token_ids)]],
                c.finish_reason,
                float(rng.random()),
            )
            for c in completions
        ]
        g = Group(
            Group.new_id(),
            "gpu-bench",
            "0-1",
            np.array(prompt, np.int32),
            samples,
            "gen-0",
            0,
            "0" * 64,
            sampling.model_dump(),
            task="copy",
        )
        groups.append(decode_group(encode_group(g)))
    tokens = sum(len(s.completion_ids) for g in groups for s in g.samples)
    del backend
    return groups, {"generate_s": gen_s, "generated_tokens": tokens, "generated_tokens_per_s": tokens / gen_s}


class Meter:
    """Peak memory of a phase: CUDA's allocator, or the RSS high-water mark (which never resets) on CPU."""

    def __init__(self, device: str):
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gb(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated() / 2**30
        from benchmarks.learner_memory import peak_rss_mb

        return peak_rss_mb() / 1024

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


def main(device: str, size_name: str, steps: int, peak_tflops: float, out: Path | None) -> dict:
    import torch

    from benchmarks.learner import plain_step
    from broker.protocol.group import sampling_transform
    from learner.config import DeepSpeedConfig, LearnerConfig
    from learner.data import collate
    from learner.engine import build_engine, load_model
    from learner.update import PolicyUpdate

    size = SIZES[size_name]
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda but torch sees no CUDA device (use --device cpu --size tiny to check the script)"
        )
    tmp = Path(tempfile.mkdtemp(prefix="relay-gpu-learner-"))
    path = build_model(tmp / "model", size["model"])
    groups, gen = sample_groups(path, device, size)

    cfg = LearnerConfig(
        run_dir=str(tmp / "run"),
        model=str(path),
        micro_batch_tokens=size["micro_batch_tokens"],
        gradient_checkpointing=size["gradient_checkpointing"],
        lr=1e-6,
        deepspeed=DeepSpeedConfig(zero_stage=2, bf16=True),
    )
    net, tok = load_model(cfg)
    params = sum(p.numel() for p in net.parameters())
    plain = copy.deepcopy(net).to(device).train()
    engine = build_engine(net, cfg)
    update = PolicyUpdate(engine, cfg, tok.pad_token_id or 0)
    meter = Meter(device)

    opt = torch.optim.AdamW(plain.parameters(), lr=cfg.optim.lr)
    advs = update.advantages(groups)
    transform = sampling_transform(groups[0].sampling)
    if size["gradient_checkpointing"]:
        plain.config.use_cache = False
        plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    b = collate(groups, advs, 0, update.pad_id)

    def plain_loop_step() -> None:
        plain_step(
            plain, opt, b, cfg.compute.micro_batch_tokens, transform, cfg.deepspeed.gradient_clipping, device, True
        )

    def learner_step() -> dict:
        return update.train_step(groups, groups[0].sampling, 0)

    trained = int(sum(len(g.prompt_ids) + len(s.completion_ids) for g in groups for s in g.samples))
    result = {
        "device": device,
        "size": size_name,
        "params": params,
        "tokens_per_step": trained,
        "micro_batch_tokens": cfg.compute.micro_batch_tokens,
        "gradient_checkpointing": cfg.compute.gradient_checkpointing,
        "engine": "DeepSpeed ZeRO-2, bf16 (fp32 master weights), torch AdamW",
        "plain": "bf16 autocast, fp32 weights, torch AdamW",
        **gen,
    }
    timings = {"learner": [], "plain": []}
    peaks = {"learner": 0.0, "plain": 0.0}
    for i in range(steps + 1):  # the first of each is a warm-up
        for name, fn in (("learner", learner_step), ("plain", plain_loop_step)):
            meter.reset()
            t0 = time.perf_counter()
            diag = fn()
            meter.sync()
            dt = time.perf_counter() - t0
            peaks[name] = max(peaks[name], meter.peak_gb())
            if name == "learner":
                result["learner_diag"] = {k: v for k, v in diag.items() if isinstance(v, (int, float))}
            if i:
                timings[name].append(dt)
    for name in timings:
        s = statistics.median(timings[name])
        tps = trained / s
        result[name] = {
            "step_s": s,
            "step_s_all": timings[name],
            "tokens_per_s": tps,
            "peak_memory_gb": peaks[name],
            "mfu": 6 * params * tps / (peak_tflops * 1e12) if device.startswith("cuda") else None,
        }
    result["ratio_tokens_per_s"] = result["learner"]["tokens_per_s"] / result["plain"]["tokens_per_s"]
    result["peak_tflops"] = peak_tflops if device.startswith("cuda") else None
    if out:
        Path(out).write_text(json.dumps(result, indent=1, allow_nan=False))
    print(json.dumps({k: v for k, v in result.items() if k != "learner_diag"}, indent=1))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=3, help="timed steps of each (after one warm-up)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak, for MFU")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    a = p.parse_args()
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if a.device.startswith("cuda") else "cpu")
    main(a.device, a.size, a.steps, a.peak_tflops, a.out)
