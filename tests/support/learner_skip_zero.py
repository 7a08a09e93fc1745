"""A skipped step leaves nothing behind at any ZeRO stage: for each stage given, two fresh engines from
the same initial weights train good batch 1, then good batch 2; the first also gets a batch with NaN
advantages in between (skipped). The weights after batch 2 must be bit-identical: the skip dropped the
NaN gradients from the optimizer's partitions and did not touch its moments.

    python -m tests.support.learner_skip_zero OUT STAGE [STAGE ...]

Writes OUT/skip.json: {stage: {"identical": bool, "skipped": n, "reason": str}}.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def run(out: Path, stage: int, poison: bool) -> tuple[str, dict | None]:
    import deepspeed
    import torch

    from benchmarks.learner import make_groups
    from learner.config import LearnerConfig
    from learner.engine import build_engine, load_model
    import learner.update as update_module
    from learner.update import PolicyUpdate

    cfg = LearnerConfig(run_dir=str(out / f"model-{stage}"), logprob_chunk_tokens=16)
    cfg.deepspeed.zero_stage = stage
    torch.manual_seed(0)
    model, _ = load_model(cfg)
    engine = build_engine(model, cfg)
    update = PolicyUpdate(engine, cfg, pad_id=0)
    groups = make_groups(6, 4, 8, seed=1)
    update.train_step(groups[:2], groups[0].sampling, 1)
    skipped = None
    if poison:
        real = update_module.batch_advantages
        update_module.batch_advantages = lambda *a: [torch.full_like(x, float("nan")) for x in real(*a)]
        skipped = update.train_step(groups[2:4], groups[0].sampling, 1)
        update_module.batch_advantages = real
    update.train_step(groups[4:6], groups[0].sampling, 1)
    h = hashlib.sha256()
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        for name, p in sorted(params.items()):
            h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest(), skipped


def main(out: Path, stages: list[int]) -> None:
    from learner.engine import init_distributed

    init_distributed()
    result = {}
    for stage in stages:
        with_skip, diag = run(out, stage, poison=True)
        without, _ = run(out, stage, poison=False)
        result[stage] = {
            "identical": with_skip == without,
            "skipped": diag["updates_skipped"],
            "reason": diag.get("skip_reason"),
        }
    (out / "skip.json").write_text(json.dumps(result))
    from learner.engine import close_distributed

    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(s) for s in sys.argv[2:]])
