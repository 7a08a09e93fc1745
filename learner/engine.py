"""The DeepSpeed training engine on CPU (gloo) or GPU (nccl)."""

from __future__ import annotations

import logging
import os

import torch

from learner.config import LearnerConfig

log = logging.getLogger("relay.learner.engine")


def init_distributed() -> None:
    """Single-process defaults when not launched by torchrun / the deepspeed launcher."""
    import deepspeed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)


def build_engine(model: torch.nn.Module, cfg: LearnerConfig):
    """Wrap ``model`` in a DeepSpeed engine with a torch AdamW (avoids compiling DeepSpeed's fused Adam)."""
    import deepspeed

    init_distributed()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.deepspeed.gradient_clipping,
        "bf16": {"enabled": cfg.deepspeed.bf16},
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage,
                              "stage3_param_persistence_threshold": cfg.deepspeed.zero3_persistence_threshold},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


def full_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The full weights for publication, on rank 0 (None on the other ranks). Every rank must call
    it: at ZeRO stage 3 each rank holds a partition of every large weight, and the weights are
    gathered layer by layer, a collective."""
    if engine.zero_optimization_stage() == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return engine.module.state_dict() if engine.global_rank == 0 else None
