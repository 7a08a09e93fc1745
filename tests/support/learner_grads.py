"""One optimizer step of the real learner update (learner/update.py, real DeepSpeed) for every
aggregation mode and policy loss, recording the gradient and the diagnostics of each, so that tests can
compare k micro-batches, and 2 ranks, with one piece on one rank.

    python -m tests.support.learner_grads OUT LABEL=MICRO_BATCH_TOKENS[/ZERO_STAGE[/OPTION[+OPTION]]] ...

OPTION: checkpointing (activation checkpointing), whole (no shared-prompt forward), packed (packed
micro-batches, learner.compute.packing, with the learner's per-sample attention: learner/packing.py),
separate (π_old by a forward of its own), sp (every rank in one
sequence-parallel group, learner.compute.sequence_parallel = ranks: the cases without a critic; the others'
entries are null).
    torchrun --standalone --nproc_per_node 2 -m tests.support.learner_grads OUT LABEL=... ...

The optimizer is plain SGD (no clipping), so the gradient is read back from the weight change:
g = (w_before − w_after) / lr, after DeepSpeed has accumulated, reduced over ranks and stepped. Every
run trains the same sequence of steps from the same initial weights on the same groups (rank r trains
groups r, r + ranks, ...). Writes OUT/LABEL-<i>.safetensors (gradients) and OUT/LABEL.json
(diagnostics per step), on rank 0; each LABEL is a fresh engine from the same initial weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (aggregation, policy loss, correction mode, minibatches, advantage): every aggregation × policy loss, plus
# the weighting (icepop) and masking (token_mis) corrections and two optimizer steps per batch, and the
# critic's estimators (the critic's gradient recorded too, its weights under "critic.")
CASES = [
    (agg, pol, "tis", 1, "grpo")
    for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    for pol in ("ppo", "cispo", "reinforce")
]
CASES += [("token-mean", "ppo", "icepop", 2, "grpo"), ("seq-mean-token-mean", "cispo", "token_mis", 2, "grpo")]
CASES += [("token-mean", "ppo", "tis", 1, "gae"), ("seq-mean-token-sum", "ppo", "tis", 2, "vtrace")]
LR = 0.1
CRITIC_LR = 0.01  # the value loss's gradients are larger: a step of 0.1 would blow the values up for the next case
SAMPLING = {"temperature": 0.9, "top_k": 10, "top_p": 0.95}


def weights(engine) -> dict:
    """Every full weight (gathered from the ranks' partitions under ZeRO-3), in fp32."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().float().clone() for n, p in params.items()}


def run(
    out: Path,
    label: str,
    micro_batch_tokens: int,
    zero_stage: int,
    checkpointing: bool = False,
    whole: bool = False,
    packed: bool = False,
    separate: bool = False,
    sp: bool = False,
) -> None:
    """One engine (``micro_batch_tokens``, ZeRO ``zero_stage``, activation ``checkpointing``, ``packed``
    micro-batches, π_old by a ``separate`` forward) through every case; results under ``label``."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from benchmarks.learner import make_groups
    from learner.config import NEEDS_CRITIC, CorrectionConfig, LearnerConfig
    from learner.critic import build_value_model
    from learner.engine import build_engine, init_distributed
    from learner.engine import load_model
    from learner.update import PolicyUpdate

    torch.manual_seed(0)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    base = LearnerConfig(
        run_dir=str(out / f"{label}-model"),
        loss_scale_tokens=12,  # T of seq-mean-token-sum-norm: make_groups' generation budget
        compute={
            "micro_batch_tokens": micro_batch_tokens,
            "gradient_checkpointing": checkpointing,
            "logprob_chunk_tokens": 16,
            "shared_prompt": not whole,  # whole: every sample computed whole, micro-batches by length alone
            "packing": packed,
            "old_logprobs_from_loss": not separate,  # separate: π_old by a forward of its own in every case
            "sequence_parallel": world if sp else 1,
        },
    )
    base.deepspeed.zero_stage, base.deepspeed.gradient_clipping = zero_stage, 0.0
    if rank == 0:
        load_model(base)
    dist.barrier()
    model, _ = load_model(base, build=False)
    if sp:
        from learner.sequence_parallel import check_sequence_parallel, sequence_group

        assert check_sequence_parallel(model, sequence_group(rank, world, world)) is None
    elif packed:  # the learner's start-up step with packing: attention one SDPA call per packed sample
        from learner.policy import _check_packing

        _check_packing(model, base, leader=rank == 0)
        assert model.config._attn_implementation == "relay_packed"
    base.critic.enabled, base.critic.deepspeed = True, base.deepspeed
    value_model = build_value_model(model, base)
    torch.nn.init.normal_(value_model.head.weight, std=0.1, generator=torch.Generator().manual_seed(0))
    engine = build_engine(model, base, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    critic = build_engine(
        value_model, base, optimizer=torch.optim.SGD(value_model.parameters(), lr=CRITIC_LR), critic=True
    )
    groups = make_groups(8, 4, 12, seed=1, sampling=SAMPLING)  # behaviour log-probs unrelated to π: stale samples
    diags = []
    for i, (agg, pol, mode, minibatches, advantage) in enumerate(CASES):
        # model_copy sets the fields it is given without validation: the moved keys (minibatches,
        # advantage) must be set in their sections, or they are attributes nothing reads
        cfg = base.model_copy(
            update={
                "aggregation": agg,
                "policy_loss": pol,
                "correction": CorrectionConfig(mode=mode),
                "optim": base.optim.model_copy(update={"minibatches": minibatches}),
                "advantages": base.advantages.model_copy(update={"estimator": advantage}),
            }
        )
        assert (cfg.optim.minibatches, cfg.advantages.estimator) == (minibatches, advantage)
        trains_critic = advantage in NEEDS_CRITIC
        if sp and trains_critic:  # not with sequence parallelism (LearnerConfig refuses it)
            diags.append(None)
            continue
        update = PolicyUpdate(engine, cfg, pad_id=0, rank=rank, world=world, critic=critic if trains_critic else None)
        before = weights(engine)
        critic_before = weights(critic) if trains_critic else {}
        diag = update.train_step(groups, groups[0].sampling, version=1)
        grads = {n: (before[n] - w) / LR for n, w in weights(engine).items()}
        if trains_critic:
            grads.update({f"critic.{n}": (critic_before[n] - w) / CRITIC_LR for n, w in weights(critic).items()})
        if rank == 0:
            save_file({n: g.contiguous() for n, g in grads.items()}, str(out / f"{label}-{i}.safetensors"))
            diags.append({k: v for k, v in diag.items() if k not in ("compute_s",)})
    if rank == 0:
        (out / f"{label}.json").write_text(json.dumps(diags, allow_nan=False))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("runs", nargs="+", help="LABEL=MICRO_BATCH_TOKENS[/ZERO_STAGE[/OPTION[+OPTION]]]")
    a = p.parse_args()
    for spec in a.runs:
        name, _, setting = spec.partition("=")
        tokens, _, rest = setting.partition("/")
        stage, _, extra = rest.partition("/")
        options = set(extra.split("+")) - {""}
        flags = ("checkpointing", "whole", "packed", "separate", "sp")
        assert options <= set(flags), options
        run(a.out, name, int(tokens), int(stage or 0), *(o in options for o in flags))
    from learner.engine import close_distributed

    close_distributed()
