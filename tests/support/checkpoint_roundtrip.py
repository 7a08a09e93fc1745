"""Checkpoint round trips through real DeepSpeed engines, run as its own process (one rank) or under
``torchrun`` (several ranks, gloo): for each engine setting, train two steps, checkpoint, train a
third; then build a fresh engine from different weights, load the checkpoint and train the same
third step. Each rank writes what a user would compare to ``<out>/rank-<r>.json``.

    python -m tests.support.checkpoint_roundtrip --out DIR 2:bf16 3:fp32 ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def run(out: Path, settings: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from learner import checkpoint, state_codec
    from learner.config import LearnerConfig
    from learner.engine import build_engine, full_state_dict, init_distributed
    from learner.tiny_model import build_tiny_model

    init_distributed()
    rank = dist.get_rank()
    model_dir = out / "model"
    if rank == 0:  # MLP weights of 160 x 640 > ZeRO-3's persistence threshold: those are really partitioned
        build_tiny_model(model_dir, hidden=160, layers=1, heads=5)
    dist.barrier()

    def engine(stage: int, bf16: bool, shift: float = 0.0):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(shift)
        return build_engine(model, LearnerConfig(deepspeed={"zero_stage": stage, "bf16": bf16}))

    def step(eng, i: int) -> float:
        x = torch.randint(0, 15, (2, 8), generator=torch.Generator().manual_seed(100 * i + rank))
        loss = eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
        return loss.item()

    def weights(eng) -> dict:  # the full weights as published: on rank 0 (a collective at ZeRO-3), {} elsewhere
        return {k: v.detach().clone() for k, v in (full_state_dict(eng) or {}).items()}

    def optimizer_state(eng):
        tree, tensors = state_codec.encode(eng.optimizer.state_dict())
        return tree, {k: v.clone() for k, v in tensors.items()}

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    results = {}
    for setting in settings:
        stage_s, precision = setting.split(":")
        stage, bf16 = int(stage_s), precision == "bf16"
        ckpt = out / f"ckpt-{stage}-{precision}"
        a = engine(stage, bf16)
        step(a, 0)
        step(a, 1)
        checkpoint.save(ckpt, 2, a, {"version": 7, "uncommitted": [["1-0", "g"]]})
        saved_weights, saved_opt = weights(a), optimizer_state(a)
        loss_continued = step(a, 2)
        continued = weights(a)

        b = engine(stage, bf16, shift=0.01)
        state = checkpoint.load(ckpt, b)
        loaded_opt = optimizer_state(b)
        loaded_weights = weights(b)
        loss_resumed = step(b, 2)
        resumed = weights(b)
        results[setting] = {
            "state": state,
            "model_numel": sum(
                v.numel() for v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().values()
            ),
            "files": sorted(p.name for p in (ckpt / "step-000002").iterdir()),
            "latest": (ckpt / "latest").read_text(),
            "published_keys": len(saved_weights),
            "published_numel": sum(v.numel() for v in saved_weights.values()),
            "weights_equal_after_load": same(saved_weights, loaded_weights),
            "optimizer_equal_after_load": saved_opt[0] == loaded_opt[0] and same(saved_opt[1], loaded_opt[1]),
            "loss_continued": loss_continued,
            "loss_resumed": loss_resumed,
            "weights_equal_after_next_step": same(continued, resumed),
            "weights_changed_by_step": not same(saved_weights, continued),
        }
        if setting == settings[-1]:  # a checkpoint read by an engine with other settings: a clear refusal
            other = engine(1 if stage != 1 else 2, bf16)
            try:
                checkpoint.load(ckpt, other)
                results["mismatch_error"] = None
            except checkpoint.CheckpointError as e:
                results["mismatch_error"] = str(e)
    (out / f"rank-{rank}.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("settings", nargs="+", help="ZeRO stage and precision, e.g. 2:bf16 3:fp32")
    args = ap.parse_args()
    run(args.out, args.settings)
    from learner.engine import close_distributed

    close_distributed()


if __name__ == "__main__":
    main()
