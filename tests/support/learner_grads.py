"""One optimizer step of the real learner update (learner/update.py, real DeepSpeed) for every
aggregation mode and policy loss, recording the gradient and the diagnostics of each, so that tests can
compare k micro-batches, and 2 ranks, with one piece on one rank.

    python -m tests.support.learner_grads OUT LABEL=MICRO_BATCH_TOKENS[/ZERO_STAGE[/OPTION[+OPTION]]] ...

OPTION: checkpointing (activation checkpointing), whole (no shared-prompt forward), packed (packed
micro-batches, learner.compute.packing, with the learner's per-sample attention: learner/packing.py),
separate (π_old by a forward of its own), sp (every rank in one
sequence-parallel group, learner.compute.sequence_parallel = ranks: the cases without a critic; the others'
entries are null), spK (sequence-parallel groups of K ranks, data-parallel across them: world = ranks / K × K).
    torchrun --standalone --nproc_per_node 2 -m tests.support.learner_grads OUT LABEL=... ...
    torchrun --standalone --nproc_per_node 4 -m tests.support.learner_grads --cases 0,4 OUT LABEL=48/0/sp2 ...

``--cases`` runs those of CASES alone (by index; the others' entries are null). With sequence parallelism each
rank also writes OUT/LABEL-rank-<r>.json: its place (sequence-parallel group and its members, data-parallel
rank and group), per case the group index of every sample it trained and the slices of the packed rows it
computed, and at ZeRO 0 its own accumulated gradient before the optimizer step (before DeepSpeed averages the
ranks'), as OUT/LABEL-rank-<r>-<i>.safetensors.

The optimizer is plain SGD (no clipping), so the gradient is read back from the weight change:
g = (w_before − w_after) / lr, after DeepSpeed has accumulated, reduced over ranks and stepped. Every
run trains the same sequence of steps from the same initial weights on the same groups (rank r trains
groups r, r + ranks, ...). Writes OUT/LABEL-<i>.safetensors (gradients) and OUT/LABEL.json
(diagnostics per step), on rank 0; each LABEL is a fresh engine from the same initial weights.
"""

from __future__ import annotations

import argparse
import json
import os
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
_REAL: dict = {}


def weights(engine) -> dict:
    """Every full weight (gathered from the ranks' partitions under ZeRO-3), in fp32."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().float().clone() for n, p in params.items()}


def place(sp) -> dict:
    """This rank's place in the world: its sequence-parallel group (its members, its rank in it) and its
    data-parallel rank and group (the members: this rank alone without one)."""
    import torch.distributed as dist

    members = dist.get_process_group_ranks
    return {
        "rank": dist.get_rank(),
        "sp_rank": sp.rank,
        "sp_members": members(sp.group),
        "dp_rank": sp.dp_rank,
        "dp": sp.dp,
        "dp_members": members(sp.dp_group) if sp.dp_group is not None else [dist.get_rank()],
        "cases": {},
    }


def record(update, engine) -> tuple[dict, list]:
    """What this rank computes in ``update``'s step: the group index of every sample of its micro-batches
    (``groups``), each packed row's slice it holds (``slices``: lo, n, the row's tokens), and at ZeRO 0
    its accumulated gradients before each optimizer step (appended to the list returned)."""
    import learner.sequence_parallel as sp_module

    seen: dict = {"groups": [], "slices": []}
    local: list = []
    real_micro_batch, real_finish = update.losses.micro_batch, update.guard.finish
    real_hidden = _REAL.setdefault("sp_hidden", sp_module.sp_hidden)  # the module's own, not a previous case's

    def micro_batch(b, part, *args):
        seen["groups"] += b.groups[part].tolist()
        return real_micro_batch(b, part, *args)

    def finish(*args):
        if engine.zero_optimization_stage() == 0:
            local.append({n: p.grad.detach().clone() for n, p in engine.module.named_parameters()})
        return real_finish(*args)

    def sp_hidden(model, input_ids, attention_mask, where, sp):
        n = -(-int(attention_mask.sum()) // sp.size)
        seen["slices"].append([sp.rank * n, n, int(attention_mask.sum())])
        return real_hidden(model, input_ids, attention_mask, where, sp)

    update.losses.micro_batch, update.guard.finish, sp_module.sp_hidden = micro_batch, finish, sp_hidden
    return seen, local


def run(
    out: Path,
    label: str,
    micro_batch_tokens: int,
    zero_stage: int,
    checkpointing: bool = False,
    whole: bool = False,
    packed: bool = False,
    separate: bool = False,
    sp: int = 0,
    cases: set[int] | None = None,
) -> None:
    """One engine (``micro_batch_tokens``, ZeRO ``zero_stage``, activation ``checkpointing``, ``packed``
    micro-batches, π_old by a ``separate`` forward, sequence-parallel groups of ``sp`` ranks) through every
    case (or those of ``cases``); results under ``label``."""
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
            "sequence_parallel": sp or 1,
        },
    )
    base.deepspeed.zero_stage, base.deepspeed.gradient_clipping = zero_stage, 0.0
    if rank == 0:
        load_model(base)
    dist.barrier()
    model, _ = load_model(base, build=False)
    if sp:
        from learner.sequence_parallel import check_sequence_parallel, sequence_group

        assert check_sequence_parallel(model, sequence_group(rank, world, sp)) is None
    elif packed:  # the learner's start-up step with packing: attention one SDPA call per packed sample
        from learner.policy import _check_packing

        _check_packing(model, base, leader=rank == 0)
        assert model.config._attn_implementation == "relay_packed"
    critic = None  # the critic's engine, built only where a case run trains it (never with SP)
    if not sp and any(CASES[i][4] in NEEDS_CRITIC for i in range(len(CASES)) if cases is None or i in cases):
        base.critic.enabled, base.critic.deepspeed = True, base.deepspeed
        value_model = build_value_model(model, base)
        torch.nn.init.normal_(value_model.head.weight, std=0.1, generator=torch.Generator().manual_seed(0))
    engine = build_engine(model, base, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    if base.critic.enabled:
        critic = build_engine(
            value_model, base, optimizer=torch.optim.SGD(value_model.parameters(), lr=CRITIC_LR), critic=True
        )
    groups = make_groups(8, 4, 12, seed=1, sampling=SAMPLING)  # behaviour log-probs unrelated to π: stale samples
    diags = []
    placed = place(sequence_group(rank, world, sp)) if sp else {}
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
        if (sp and trains_critic) or (cases is not None and i not in cases):  # no critic with SP (LearnerConfig)
            diags.append(None)
            continue
        update = PolicyUpdate(engine, cfg, pad_id=0, rank=rank, world=world, critic=critic if trains_critic else None)
        if sp:
            placed["cases"][str(i)], local = record(update, engine)
        before = weights(engine)
        critic_before = weights(critic) if trains_critic else {}
        diag = update.train_step(groups, groups[0].sampling, version=1)
        grads = {n: (before[n] - w) / LR for n, w in weights(engine).items()}
        if trains_critic:
            grads.update({f"critic.{n}": (critic_before[n] - w) / CRITIC_LR for n, w in weights(critic).items()})
        if sp and zero_stage == 0:  # this rank's own gradient, summed over the case's optimizer steps
            mine = {n: sum(g[n] for g in local) for n in local[0]}
            save_file(mine, str(out / f"{label}-rank-{rank}-{i}.safetensors"))
        if rank == 0:
            save_file({n: g.contiguous() for n, g in grads.items()}, str(out / f"{label}-{i}.safetensors"))
            diags.append({k: v for k, v in diag.items() if k not in ("compute_s",)})
    if rank == 0:
        (out / f"{label}.json").write_text(json.dumps(diags, allow_nan=False))
    if sp:
        (out / f"{label}-rank-{rank}.json").write_text(json.dumps(placed))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--cases", help="comma-separated indices of CASES to run (default: all)")
    p.add_argument("out", type=Path)
    p.add_argument("runs", nargs="+", help="LABEL=MICRO_BATCH_TOKENS[/ZERO_STAGE[/OPTION[+OPTION]]]")
    a = p.parse_args()
    for spec in a.runs:
        name, _, setting = spec.partition("=")
        tokens, _, rest = setting.partition("/")
        stage, _, extra = rest.partition("/")
        options = set(extra.split("+")) - {""}
        sizes = {o for o in options if o.startswith("sp")}  # sp: every rank in one group; spK: groups of K
        flags = ("checkpointing", "whole", "packed", "separate")
        assert options - sizes <= set(flags) and len(sizes) <= 1, options
        world = int(os.environ.get("WORLD_SIZE", "1"))
        sp = max((int(o[2:] or world) for o in sizes), default=0)
        cases = {int(c) for c in a.cases.split(",")} if a.cases else None
        run(a.out, name, int(tokens), int(stage or 0), *(o in options for o in flags), sp=sp, cases=cases)
    from learner.engine import close_distributed

    close_distributed()
