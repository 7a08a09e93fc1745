"""Ulysses sequence parallelism (``learner.compute.sequence_parallel`` = k): each micro-batch's packed row split
into k contiguous slices, one per rank of a sequence-parallel group, and attention computed with an all-to-all
over heads (DeepSpeed-Ulysses, arXiv:2309.14509; ALST, arXiv:2506.13996).

A rank holds n = ⌈N / k⌉ tokens of the row (the row padded to k·n with a segment of its own, which nothing
attends to). Everything but attention is per token and runs on the rank's slice alone: embeddings, the MLPs,
the norms, the output head and the chunked log-probs (learner/logprobs.py) of the positions in the slice.
In each attention layer the rank's queries, keys and values [n, H, D] go through an all-to-all that gives it
all N positions of its share of the heads [N, H_r, D]; it computes causal attention within each packed sample
(one SDPA call per sample, ``is_causal``: no N × N mask), and a second all-to-all gives every rank its
positions back, with every head. Memory per rank: the activations of n tokens, and the attention of N tokens
over H / k heads.

Heads are shared out by key-value group (GQA), as evenly as they go: SmolLM2-135M's 9 query heads in 3
key-value groups over 2 ranks are 6 + 3. A rank with no key-value head would have nothing to compute, so k
may not exceed the key-value heads. The exchange is ``all_to_all_single`` with uneven splits, which gloo (CPU)
and NCCL both do.

Why not DeepSpeed's ``UlyssesSPAttentionHF`` (deepspeed.runtime.sequence_parallel.ulysses_sp, installed
0.19.8): it needs the heads and the key-value heads divisible by k (SmolLM2-135M's 9 heads cannot be split
over 2 ranks), every rank's slice of one length (no uneven split) and, with SDPA (the CPU path), it drops the
attention mask and runs causal attention over the whole row, so packed samples would attend to each other
(only its flash-attention path reads packed ``position_ids``). Relay's attention is registered the same way
(transformers' attention interface, ``attn_implementation``), follows the same two exchanges, and lifts those
three limits; DeepSpeed's engine, ZeRO stages and checkpoints are used unchanged.

The log-probs: each rank computes those of the positions in its slice, scatters them into the micro-batch's
[B, L-1] (0 elsewhere) and the group sums them (:func:`sp_sum`: forward an all-reduce, backward the identity).
Every rank of the group then holds the micro-batch's whole log-probs and computes the same loss with the same
normalisers as without SP; the backward of each rank reaches only its own positions, so the group's gradients
add up to the step's gradient (DeepSpeed sums them over the world and the loss is scaled by the world size:
learner/ranks.py). Data parallelism runs across groups: world = dp × k, rank r in group r // k.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from learner.packing import NO_LOGITS, Packed, row_bounds, segment_attention

ATTENTION = "relay_ulysses"  # the attn_implementation name registered with transformers


@dataclass
class SequenceGroup:
    """This rank's place in the world: ``size`` ranks per sequence-parallel group, this rank ``rank`` of its
    ``group``; data-parallel rank ``dp_rank`` of ``dp`` (the ranks with its ``rank`` in every group make
    ``dp_group``)."""

    size: int
    rank: int
    group: object
    dp_rank: int
    dp: int
    dp_group: object

    @classmethod
    def of(cls, rank: int, world: int, size: int) -> SequenceGroup:
        """The groups of ``world`` ranks, ``size`` per sequence (contiguous: ranks 0..size-1 share sequences).
        Every rank must call this, in the same order (``dist.new_group`` is a collective)."""
        if world % size:
            raise ValueError(f"learner.compute.sequence_parallel ({size}) must divide the learner's {world} ranks")
        dp = world // size
        group = dp_group = None
        for d in range(dp):  # every rank creates every group
            g = dist.new_group(list(range(d * size, (d + 1) * size)))
            if d == rank // size:
                group = g
        for s in range(size):
            g = dist.new_group(list(range(s, world, size))) if dp > 1 else None
            if s == rank % size:
                dp_group = g
        return cls(size, rank % size, group, rank // size, dp, dp_group)


@functools.cache
def sequence_group(rank: int, world: int, size: int) -> SequenceGroup:
    """The :class:`SequenceGroup` of this rank, its process groups made once per process."""
    return SequenceGroup.of(rank, world, size)


def head_split(heads: int, kv_heads: int, size: int) -> tuple[list[int], list[int]]:
    """Query and key-value heads of each of ``size`` ranks: whole key-value groups, as even as they go."""
    if kv_heads < size or heads % kv_heads:
        raise ValueError(f"{heads} heads in {kv_heads} key-value heads cannot be split over {size} ranks")
    kv = [kv_heads // size + (r < kv_heads % size) for r in range(size)]
    return [k * (heads // kv_heads) for k in kv], kv


class _Exchange(torch.autograd.Function):
    """One all-to-all of the sequence-parallel ``group``: ``x`` [A, n, D] split along dim 0 in ``send`` parts
    (part r to rank r); returns [Σ recv · m ...] as received, rank by rank. Its backward is the reverse
    exchange (the same all-to-all with the splits swapped)."""

    @staticmethod
    def forward(ctx, x, send, recv, width, group):
        ctx.send, ctx.recv, ctx.width, ctx.group, ctx.in_width = send, recv, width, group, x.shape[1]
        return _all_to_all(x, send, recv, width, group)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.recv, ctx.send, ctx.in_width, ctx.group), None, None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], width: int, group) -> torch.Tensor:
    """``x`` [Σ send, w, D] -> [Σ recv, width, D] over ``group``: rows send[r] to rank r, recv[r] rows of
    ``width`` from rank r."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), width, x.shape[-1]))
    w = x.shape[1] * x.shape[-1]
    dist.all_to_all_single(
        out.view(-1),
        x.view(-1),
        output_split_sizes=[r * width * x.shape[-1] for r in recv],
        input_split_sizes=[s * w for s in send],
        group=group,
    )
    return out


@dataclass
class Shard:
    """One rank's slice of a packed row: ``lo``..``lo + n`` of its ``bounds`` (each sample's start, and the
    row's padded end), the group ``sp``. Passed to the model as the keyword ``relay_sp``, which reaches every
    attention layer (recomputed ones included, with activation checkpointing)."""

    sp: SequenceGroup
    bounds: list[int]
    lo: int
    n: int


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface (``attn_implementation = relay_ulysses``): ``query`` [1, H, n, D],
    ``key``/``value`` [1, K, n, D] of this rank's slice -> ([1, n, H, D], None). Without a ``relay_sp`` shard
    (one rank, or a start-up check) it attends within the packed samples locally (their bounds computed once
    for the forward, learner/packing.py ``row_bounds``, else read from ``position_ids``). The
    mask is never read: rows are packed (no padding) and causal within each sample."""
    if dropout or kwargs.get("sliding_window") or kwargs.get("softcap") or query.shape[0] != 1:
        raise ValueError(
            f"{ATTENTION}: dropout, sliding windows, soft-capping and rows other than one packed row are not "
            "supported (learner.compute.sequence_parallel)"
        )
    shard: Shard | None = kwargs.get("relay_sp")
    if shard is None:
        out = segment_attention(query, key, value, row_bounds(kwargs, query.shape[2]), scaling)
        return out.transpose(1, 2), None
    sp = shard.sp
    qh, kvh = head_split(query.shape[1], key.shape[1], sp.size)
    n, N = shard.n, shard.n * sp.size

    def gather(x, split):  # [1, A, n, D] -> [1, A_r, N, D]: every position of this rank's heads
        out = _Exchange.apply(x[0], split, [split[sp.rank]] * sp.size, n, sp.group)  # [k·A_r, n, D]
        return out.view(sp.size, split[sp.rank], n, -1).transpose(0, 1).reshape(1, split[sp.rank], N, -1)

    out = segment_attention(gather(query, qh), gather(key, kvh), gather(value, kvh), shard.bounds, scaling)
    mine = qh[sp.rank]  # [1, H_r, N, D] -> [k·H_r, n, D] (positions of rank r in part r) -> [H, n, D]
    back = out[0].view(mine, sp.size, n, -1).transpose(0, 1).reshape(sp.size * mine, n, -1)
    local = _Exchange.apply(back, [mine] * sp.size, qh, n, sp.group)
    return local.transpose(0, 1)[None], None


def enable(model) -> None:
    """Register :func:`ulysses_attention` with transformers and make it ``model``'s attention."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)
    model.set_attn_implementation(ATTENTION)


class _GroupSum(torch.autograd.Function):
    """Forward: ``x`` summed over the group (each rank holds its own positions, 0 elsewhere); backward: the
    identity (every rank computes the same loss of the sum, so each one's gradient is already the whole)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def sp_sum(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """``x`` summed over the sequence-parallel group (:class:`_GroupSum`; a bool tensor: any rank's)."""
    if x.dtype == torch.bool:
        y = x.to(torch.uint8)
        dist.all_reduce(y, group=sp.group)
        return y.bool()
    return _GroupSum.apply(x, sp.group)


def sp_hidden(model, input_ids, attention_mask, where, sp: SequenceGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The last hidden states [m, H] of the positions ``where`` (rows, columns of the padded batch) that lie in
    this rank's slice of the batch packed into one row, and which of ``where`` they are (a bool [len(where)])."""
    p = Packed.of(input_ids, attention_mask)
    N = p.input_ids.shape[1]
    n = -(-N // sp.size)
    pad = n * sp.size - N  # a segment of its own at the end: nothing attends to it
    ids = torch.cat([p.input_ids, p.input_ids.new_zeros((1, pad))], dim=1)
    pos = torch.cat([p.position_ids, torch.arange(pad, device=ids.device)[None]], dim=1)
    bounds = sorted(set(p.starts.tolist() + [N, n * sp.size]))
    lo = sp.rank * n
    out = model(
        input_ids=ids[:, lo : lo + n],
        position_ids=pos[:, lo : lo + n],
        attention_mask=None,
        logits_to_keep=NO_LOGITS,
        output_hidden_states=True,
        use_cache=False,
        relay_sp=Shard(sp, bounds, lo, n),
    )
    cols = p.columns(*where)
    local = (cols >= lo) & (cols < lo + n)
    return out.hidden_states[-1][0, cols[local] - lo], local


def check_sequence_parallel(model, sp: SequenceGroup) -> str | None:
    """Why ``model``'s attention cannot be split over the group ``sp`` (None: it can). Every rank of the group
    runs it at start-up, together: the heads must split into whole key-value groups, and one packed row of two
    samples (7 and 4 tokens: 11, split unevenly) computed split must give each position's hidden state of the
    samples computed whole, on one rank, to rounding. Leaves the model's attention Ulysses' (:func:`enable`)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads is None:
        return f"{type(model).__name__} has no num_attention_heads in its config"
    try:
        head_split(heads, kv, sp.size)
    except ValueError as e:
        return str(e)
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "attn_logit_softcapping", None):
        return "sliding-window or soft-capped attention"
    vocab = model.get_input_embeddings().num_embeddings
    lens = [7, 4]
    ids = torch.zeros(2, 7, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = (torch.arange(n) * 5 + 3 * b + 1) % vocab
    attn = (torch.arange(7)[None] < torch.tensor(lens)[:, None]).long()
    device = next(model.parameters()).device
    ids, attn = ids.to(device), attn.to(device)
    where = attn.bool().nonzero(as_tuple=True)
    try:
        with torch.no_grad():
            whole = [
                model(input_ids=ids[b : b + 1, :n], output_hidden_states=True, use_cache=False)
                for b, n in enumerate(lens)
            ]
            alone = torch.cat([o.hidden_states[-1][0] for o in whole])
            enable(model)  # from here on the model's attention is Ulysses'
            h, local = sp_hidden(model, ids, attn, where, sp)
    except (RuntimeError, TypeError, ValueError, KeyError) as e:
        return f"{type(e).__name__}: {e}"
    alone = alone[local]
    diff = float((h.float() - alone.float()).abs().max()) if len(h) else 0.0
    scale = float(alone.float().abs().max()) if len(h) else 1.0
    tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    return None if diff <= tol * (scale or 1.0) else f"hidden states differ from whole samples by {diff:.3g}"
