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


def make_groups(n_groups: int, n: int, max_tokens: int, seed: int = 0):
    """Copy-task groups as the generators send them: ``473=`` prompts, random digit completions ending
    in EOS, behaviour log-probs in [-3, 0), rewards in [0, 1]; through the wire codec and back."""
    from broker.protocol.group import Group, Sample, decode_group, encode_group

    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(n_groups):
        prompt = np.array([1, *rng.integers(3, 13, 3), 14], dtype=np.int32)
        samples = []
        for _ in range(n):
            t = int(rng.integers(2, max_tokens + 1))
            ids = np.append(rng.integers(3, 13, t - 1), 2).astype(np.int32)
            samples.append(Sample(ids, -rng.uniform(0.01, 3.0, t).astype(np.float32), [[0, t]], "stop",
                                  float(rng.random())))
        g = Group(Group.new_id(), "bench", "0-1", prompt, samples, "gen-0", 0, "0" * 64,
                  {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": max_tokens, "n": n}, task="copy")
        groups.append(decode_group(encode_group(g)))
    return groups


def run(quick: bool) -> list[dict]:
    import torch

    from learner.config import LearnerConfig
    from learner.data import collate
    from learner.trainer import Learner

    batch_groups, n, max_tokens = (4, 8, 8) if quick else (32, 8, 8)
    steps, warmup = (3, 1) if quick else (30, 3)
    with tempfile.TemporaryDirectory(prefix="relay-bench-learner-") as tmp, Stack(Path(tmp)) as stack:
        cfg = LearnerConfig(run_id="bench", redis_url=stack.redis(), run_dir=str(Path(tmp) / "learner"),
                            weight_store=str(Path(tmp) / "weights"), batch_groups=batch_groups, checkpoint_every=0)
        learner = Learner(cfg)
        groups = make_groups(batch_groups, n, max_tokens)
        sampling = groups[0].sampling

        # the plain loop: the same initial weights, optimizer, clipping; a token-mean policy-gradient loss
        model = copy.deepcopy(learner.engine.module).train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        advs = [learner.update.advantage_fn(torch.tensor([s.reward for s in g.samples])) for g in groups]
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
    return [row("learner", v, base, "s per optimizer step", TARGET, "lower", {
        "model_params": params, "groups": batch_groups, "samples": batch_groups * n, "completion_tokens": tokens,
        "steps_timed": steps, "learner_s_min": min(ours), "plain_s_min": min(plain),
        "engine": f"DeepSpeed ZeRO {cfg.deepspeed.zero_stage}, fp32, torch AdamW, clip {cfg.deepspeed.gradient_clipping}",
        "correction": cfg.correction.mode, "policy_loss": cfg.policy_loss, "threads": cfg.threads})]
