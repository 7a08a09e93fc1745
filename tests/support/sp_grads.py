"""Log-probs, entropy, a loss and its gradients of one Llama (9 query heads in 3 key-value groups, like
SmolLM2-135M) on one packed row, computed on one rank (``torch.distributed`` not started: the row packed) or
split over the ranks of a sequence-parallel group (learner/sequence_parallel.py), so a test can compare them.

    python -m tests.support.sp_grads OUT one
    torchrun --standalone --nproc_per_node 2 -m tests.support.sp_grads OUT split

The batch: one sequence of 37 tokens (odd: the split is uneven, 19 + 18 with a padding token) and a packed
micro-batch of three samples (13, 6 and 10 tokens). The split gradients are summed over the ranks (what
DeepSpeed's reduction does), then written on rank 0 as OUT/LABEL.safetensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TRANSFORM = (0.9, 0, 1.0)


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=72,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).float()


def batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, positions) of the two micro-batches, right-padded."""
    g = torch.Generator().manual_seed(1)
    out = []
    for lens, prompts in (([37], [5]), ([13, 6, 10], [4, 2, 3])):
        width = max(lens)
        ids = torch.randint(1, 50, (len(lens), width), generator=g)
        attn = (torch.arange(width)[None] < torch.tensor(lens)[:, None]).long()
        ids = ids * attn
        pos = torch.zeros(len(lens), width - 1)
        for b, (n, p) in enumerate(zip(lens, prompts)):
            pos[b, p - 1 : n - 1] = 1.0  # completion tokens only
        out.append((ids, attn, pos))
    return out


def run(out: Path, label: str) -> None:
    from safetensors.torch import save_file

    from learner.logprobs import token_logprobs

    sp = None
    if label == "split":
        import torch.distributed as dist

        from learner.sequence_parallel import check_sequence_parallel, sequence_group

        dist.init_process_group("gloo")
        sp = sequence_group(dist.get_rank(), dist.get_world_size(), dist.get_world_size())
    m = model()
    if sp is not None:
        assert check_sequence_parallel(m, sp) is None
    results = {}
    for i, (ids, attn, pos) in enumerate(batches()):
        m.zero_grad()
        lp = token_logprobs(m, ids, attn, pos, TRANSFORM, 5, entropy=True, packed=True, sp=sp)
        adv = torch.linspace(-1.0, 1.0, len(ids))[:, None]
        loss = -(lp.logp * adv * pos).sum() / pos.sum() - 0.1 * (lp.entropy * pos).sum() / pos.sum()
        loss.backward()
        results[f"{i}.logp"], results[f"{i}.entropy"] = lp.logp.detach(), lp.entropy.detach()
        results[f"{i}.loss"] = loss.detach()[None]
        for n, p in m.named_parameters():
            g = p.grad.clone()
            if sp is not None:
                torch.distributed.all_reduce(g)
            results[f"{i}.grad.{n}"] = g
    if sp is None or torch.distributed.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in results.items()}, str(out / f"{label}.safetensors"))
    if sp is not None:  # every rank leaves together (a rank that leaves first can abort in gloo's destructors)
        from learner.engine import close_distributed

        close_distributed()


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2])
