"""A real learner (learner/trainer.py: real DeepSpeed on CPU, ZeRO 2 in fp32, the tiny model, a real Redis) with
sequence parallelism, run under ``torchrun`` with 2 ranks in one sequence-parallel group
(``learner.compute.sequence_parallel = 2``), two minibatches per batch (a random split: two optimizer steps),
checkpointing every 2 steps and publishing every step. The groups
are already in RUN_ID's stream (the test puts them there); the learner trains STEPS steps, resuming from the
newest checkpoint in RUN_DIR when there is one.

    torchrun --standalone --nproc_per_node 2 -m tests.support.learner_sp_resume REDIS_URL RUN_DIR RUN_ID STEPS TAG

Each rank writes RUN_DIR/TAG-start-<rank>.* once the learner is built (after it resumed) and RUN_DIR/TAG-end-<rank>.*
after its run: ``.safetensors`` the weights this rank holds ("w.<name>") and its optimizer state (its ZeRO
partition, "o.<key>", flattened by learner.state_codec), ``.json`` the learner's step and the state's tree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 11


def dump(learner, path: Path) -> None:
    """The weights and the optimizer state this rank holds, and the learner's step."""
    from safetensors.torch import save_file

    from learner import state_codec

    engine = learner.engine
    tree, tensors = state_codec.encode(engine.optimizer.state_dict())
    weights = {f"w.{n}": p.detach().float().clone() for n, p in engine.module.named_parameters()}
    save_file(
        {**weights, **{f"o.{k}": v.contiguous() for k, v in tensors.items()}}, str(path.with_suffix(".safetensors"))
    )
    path.with_suffix(".json").write_text(json.dumps({"step": learner.step, "optimizer": tree}))


def main(redis_url: str, run_dir: Path, run_id: str, steps: int, tag: str) -> None:
    import logging

    import torch.distributed as dist

    from broker.protocol.signing import write_key_pair
    from learner.config import LearnerConfig
    from learner.engine import close_distributed
    from learner.trainer import Learner

    key = run_dir / "announce.key"
    cfg = LearnerConfig(
        announce_key_file=str(key),
        run_id=run_id,
        redis_url=redis_url,
        run_dir=str(run_dir),
        weight_store=str(run_dir / "weights"),
        seed=SEED,
        steps=steps,
        batch_groups=4,
        publish_every=1,
        checkpoint_every=2,
        tensorboard=False,
        rank_checksums=True,
        wait_timeout_s=60,
        admission_eta=None,
        deepspeed={"zero_stage": 2, "bf16": False},
        compute={"sequence_parallel": 2, "micro_batch_tokens": 24},
        optim={"minibatches": 2},  # two optimizer steps per batch, on a random split of it
    )
    from learner.engine import init_distributed

    rank, _ = init_distributed()
    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(name)s %(levelname)s %(message)s")
    if rank == 0 and not key.exists():  # the learner signs what it announces: one key for the run, resumed too
        run_dir.mkdir(parents=True, exist_ok=True)
        write_key_pair(key, run_dir / "announce.pub")
    dist.barrier()
    learner = Learner(cfg)
    dump(learner, run_dir / f"{tag}-start-{rank}")
    learner.run()
    dump(learner, run_dir / f"{tag}-end-{rank}")
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
