"""learner: seconds per optimizer step of the real learner (``PolicyUpdate.train_step``: advantages,
collation, the forward under the sampling transform, the PPO-clip loss with off-policy correction and
its diagnostics, DeepSpeed's backward, gradient clipping and step), against a plain PyTorch loop that
does the same forward, backward, clipping and AdamW step on the same batch.

Both start from the same weights and train on the same groups (decoded from their wire bytes, as the
learner reads them), one step each in turn, so both see the same machine load.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Stack, row

TARGET = 1.15


def make_groups(
    n_groups: int,
    n: int,
    max_tokens: int,
    seed: int = 0,
    vocab: int = 13,
    prompt_tokens: int = 3,
    min_tokens: int = 2,
    sampling: dict | None = None,
):
    """Groups as the generators send them, through the wire codec and back: prompts ``BOS t1..tk =``
    and random completions of ``min_tokens``..``max_tokens`` tokens ending in EOS (token ids 3..vocab-1;
    the defaults are the copy task's digits), behaviour log-probs in [-3, 0), rewards in [0, 1]."""
    from broker.protocol.group import Group, Sample, decode_group, encode_group

    rng = np.random.default_rng(seed)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **(sampling or {}), "max_tokens": max_tokens, "n": n}
    groups = []
    for _ in range(n_groups):
        prompt = np.array([1, *rng.integers(3, vocab, prompt_tokens), 14], dtype=np.int32)
        samples = []
        for _ in range(n):
            t = int(rng.integers(min_tokens, max_tokens + 1))
            ids = np.append(rng.integers(3, vocab, t - 1), 2).astype(np.int32)
            samples.append(
                Sample(ids, -rng.uniform(0.01, 3.0, t).astype(np.float32), [[0, t]], "stop", float(rng.random()))
            )
        g = Group(Group.new_id(), "bench", "0-1", prompt, samples, "gen-0", 0, "0" * 64, sampling, task="copy")
        groups.append(decode_group(encode_group(g)))
    return groups


def plain_step(
    model,
    optimizer,
    b,
    micro_batch_tokens: int,
    transform: tuple,
    clip: float,
    device: str = "cpu",
    bf16_autocast: bool = False,
) -> None:
    """The plain PyTorch baseline of one optimizer step on the collated batch ``b``: the learner's
    micro-batches (learner/data.py), each forward with full logits through the sampling transform, a
    token-mean policy-gradient loss over the whole batch (tokens outside the kept set left out),
    backward; then clipping and the optimizer step."""
    import torch

    from broker.protocol.sampling import sampling_logprobs
    from learner.data import micro_batches

    total = b.loss_mask.sum()
    for rows in micro_batches(b.lengths, torch.arange(len(b.lengths)), micro_batch_tokens):
        mb = b.select(rows).to(device)
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=bf16_autocast):
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
        lp = sampling_logprobs(logits, *transform).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
        valid = mb.loss_mask.bool() & torch.isfinite(lp)
        lp = torch.where(valid, lp, 0.0)
        (-(mb.advantages * torch.exp(lp - lp.detach()) * valid).sum() / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run(quick: bool) -> list[dict]:
    import torch

    from learner.config import LearnerConfig
    from learner.data import collate
    from learner.trainer import Learner

    batch_groups, n, max_tokens = (4, 8, 8) if quick else (32, 8, 8)
    steps, warmup = (3, 1) if quick else (30, 3)
    with tempfile.TemporaryDirectory(prefix="relay-bench-learner-") as tmp, Stack(Path(tmp)) as stack:
        cfg = LearnerConfig(
            run_id="bench",
            redis_url=stack.redis(),
            run_dir=str(Path(tmp) / "learner"),
            weight_store=str(Path(tmp) / "weights"),
            batch_groups=batch_groups,
            checkpoint_every=0,
            announce_key_file=stack.announce_key_file,
        )
        learner = Learner(cfg)
        groups = make_groups(batch_groups, n, max_tokens)
        sampling = groups[0].sampling

        # the plain loop: the same initial weights, optimizer, clipping; a token-mean policy-gradient loss
        model = copy.deepcopy(learner.engine.module).train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        advs = learner.update.advantages(groups)
        b = collate(groups, advs, 0, learner.update.pad_id)

        def plain_step() -> None:
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
            logp = torch.log_softmax(logits, -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
            loss = -(b.advantages * torch.exp(logp - logp.detach()) * b.loss_mask).sum() / b.loss_mask.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.deepspeed.gradient_clipping)
            opt.step()
            opt.zero_grad(set_to_none=True)

        ours, plain = [], []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            learner.update.train_step(groups, sampling, 0)
            t1 = time.perf_counter()
            plain_step()
            t2 = time.perf_counter()
            if i >= warmup:
                ours.append(t1 - t0)
                plain.append(t2 - t1)
        v, base = statistics.median(ours), statistics.median(plain)
        tokens = int(b.loss_mask.sum())
        params = sum(p.numel() for p in model.parameters())
    return [
        row(
            "learner",
            v,
            base,
            "s per optimizer step",
            TARGET,
            "lower",
            {
                "model_params": params,
                "groups": batch_groups,
                "samples": batch_groups * n,
                "completion_tokens": tokens,
                "steps_timed": steps,
                "learner_s_min": min(ours),
                "plain_s_min": min(plain),
                "engine": f"DeepSpeed ZeRO {cfg.deepspeed.zero_stage}, fp32, torch AdamW, clip {cfg.deepspeed.gradient_clipping}",
                "correction": cfg.correction.mode,
                "policy_loss": cfg.policy_loss,
                "threads": cfg.compute.threads,
            },
        )
    ]
