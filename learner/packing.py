"""Packed micro-batches (``learner.compute.packing``): the samples of a micro-batch concatenated into one row
of Σ lengths tokens, with no padding, each sample attending only to itself.

The row goes to the model with ``position_ids`` that restart at 0 at each sample and no attention mask:
transformers reads the sample boundaries from where the positions restart. With SDPA, eager or flex
attention (the CPU path), ``masking_utils.find_packed_sequence_indices`` turns them into a block-diagonal
causal mask; with ``flash_attention_2``/``3`` (the GPU path) ``modeling_flash_attention_utils`` turns them
into the ``cu_seqlens`` of flash-attention's variable-length kernel, which never computes across a
boundary. Either way each sample's hidden states are those of the sample computed alone (rotary position
embeddings included: they follow ``position_ids``), so log-probs, entropy, losses and gradients are
those of the padded micro-batch, to rounding (tests/unit/learner/test_packing.py). The cache must be off
(``use_cache=False``): transformers looks for packed positions only without one.

On CPU that mask costs the whole row: SDPA takes it as a dense N × N mask (N = Σ lengths) and computes every
query against every key, the cross-sample ones masked out, so a packed micro-batch of 2,048 tokens pays 2,048²
per head and layer where its samples alone pay Σ L². The learner therefore replaces SDPA, for a model that uses
it, by :func:`packed_attention` (``attn_implementation = relay_packed``, set by :func:`use_packed_attention` at
start-up with packing): for one row without a mask or a cache it calls SDPA once per sample (``is_causal``, the
sample's slice of the queries, keys and values, the boundaries read from ``position_ids`` once per forward, by
:class:`Packed`, and handed to every layer as the keyword ``relay_segments``: one host sync per forward, not one
per layer), and transformers builds no mask for it (:func:`packed_mask`); anything else (padded rows with their
mask, a KV cache) goes to transformers' own SDPA with its own mask, unchanged. Exact: the same kernel on the same numbers as each sample
alone (tests/unit/learner/test_packing.py compares it with the masked path and the padded rows).

The micro-batches themselves hold up to ``micro_batch_tokens`` tokens (Σ lengths, no padding), filled
longest first into the first micro-batch with room (first-fit decreasing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_LOGITS = torch.empty(0, dtype=torch.long)  # logits_to_keep: the forward computes no logits at all
ATTENTION = "relay_packed"  # the attn_implementation name registered with transformers (packed_attention)
# the keyword that brings a packed row's sample bounds (Packed.bounds) to every attention layer of one forward, and
# the attentions that read it (this one and learner/sequence_parallel.py's)
SEGMENTS = "relay_segments"
READS_SEGMENTS = (ATTENTION, "relay_ulysses")


def segments(position_ids: torch.Tensor) -> list[int]:
    """The packed samples' starts (where the positions restart) and the row's end, of ``position_ids`` [1, N]."""
    pos = position_ids[0]
    starts = (pos == 0).nonzero().flatten().tolist()
    return ([0] if not starts or starts[0] != 0 else []) + starts + [len(pos)]


def row_bounds(kwargs: dict, length: int) -> list[int]:
    """The packed samples' bounds of an attention call's ``kwargs``: those its forward computed once
    (``relay_segments``: :func:`segment_kwargs`), else read from its ``position_ids`` (a host sync), else one
    sample of ``length``."""
    bounds = kwargs.get(SEGMENTS)
    if bounds is None:
        pos = kwargs.get("position_ids")
        return segments(pos) if pos is not None else [0, length]
    if bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"{SEGMENTS} {bounds[:3]}...{bounds[-1:]} do not cover the row of {length} tokens")
    return bounds


def segment_kwargs(model, bounds: list[int]) -> dict:
    """The keyword of ``model``'s forward (a transformers model, or its DeepSpeed engine) that brings ``bounds``
    to its attention layers, computed once for the forward instead of once per layer (each layer, and each
    layer recomputed by activation checkpointing, gets the same list): for Relay's attentions alone; another
    attention takes no such keyword ({})."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return {SEGMENTS: bounds} if impl in READS_SEGMENTS else {}


def segment_attention(q, k, v, bounds: list[int], scaling: float | None) -> torch.Tensor:
    """Causal attention [1, H, N, D] within each segment ``bounds`` (one SDPA call each, no mask): ``q``
    [1, H, N, D], ``k``/``v`` [1, K, N, D] (H a multiple of K: grouped-query attention)."""
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=scaling, enable_gqa=True
        )
        for s, e in zip(bounds[:-1], bounds[1:])
        if e > s
    ]
    return torch.cat(parts, dim=2)


def _one_row(batch: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0) -> bool:
    return batch == 1 and q_length == kv_length and not q_offset and not kv_offset


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface (``attn_implementation = relay_packed``): for one row without a mask
    or a cache (``query`` [1, H, N, D], keys as long), causal attention within each packed sample of
    ``position_ids`` (:func:`segment_attention`; the bounds computed once for the forward, :func:`row_bounds`)
    -> ([1, N, H, D], None); otherwise transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pos = kwargs.get("position_ids")
    if (
        attention_mask is not None
        or pos is None
        or dropout
        or not _one_row(query.shape[0], *query.shape[2:3], key.shape[2])
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    bounds = row_bounds(kwargs, query.shape[2])
    return segment_attention(query, key, value, bounds, scaling).transpose(1, 2).contiguous(), None


def packed_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """transformers' mask interface for ``relay_packed``: no mask for one row without padding or a cache
    (:func:`packed_attention` reads the samples from ``position_ids``), SDPA's mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and _one_row(batch_size, q_length, kv_length, q_offset, kv_offset):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask, **kwargs)


def use_packed_attention(model, on: bool = True) -> bool:
    """Make ``model``'s attention :func:`packed_attention` (``on``) or SDPA again; False (nothing changed) for a
    model that does not use SDPA through transformers' attention interface, or whose attention has sliding
    windows or soft-capping (the per-sample calls know neither): it keeps its own attention and its mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return False
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    sliding = getattr(cfg, "use_sliding_window", getattr(cfg, "sliding_window", None) is not None)
    sliding = sliding or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or [])
    if (
        sliding
        or getattr(cfg, "attn_logit_softcapping", None)
        or config._attn_implementation not in ("sdpa", ATTENTION)
    ):
        return False
    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, packed_mask)
    model.set_attn_implementation(ATTENTION if on else "sdpa")
    return True


@dataclass
class Packed:
    """The rows of a right-padded batch packed into one row."""

    input_ids: torch.Tensor  # [1, N] every sample's tokens, one after the other (N = Σ lengths)
    position_ids: torch.Tensor  # [1, N] each sample's positions, from 0
    starts: torch.Tensor  # [B] the column of each sample's first token in the row
    lengths: torch.Tensor  # [B] each sample's tokens

    @property
    def bounds(self) -> list[int]:
        """Each sample's start and the row's end (:func:`segments`): one host sync, once per forward."""
        return segments(self.position_ids)

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
        """``input_ids`` [B, L] right-padded, ``attention_mask`` [B, L] 1 on each row's tokens (a prefix)."""
        lengths = attention_mask.sum(-1).long()
        starts = torch.cumsum(lengths, 0) - lengths
        n = int(lengths.sum())
        pos = torch.arange(n, device=input_ids.device) - starts.repeat_interleave(lengths)
        return cls(input_ids[attention_mask.bool()][None], pos[None], starts, lengths)

    def columns(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The row's columns of the padded batch's positions (``rows``, ``cols``)."""
        return self.starts.to(rows.device)[rows] + cols

    def unpack(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """``x`` [1, N, ...] of the packed row (position j predicting token j + 1) as [B, width, ...] of the
        padded batch: each row's positions 0 .. length − 2 (those that predict a token of the sample), 0
        elsewhere."""
        dev = x.device
        rows, cols = (torch.arange(width, device=dev)[None] < (self.lengths.to(dev) - 1)[:, None]).nonzero(
            as_tuple=True
        )
        out = x.new_zeros((len(self.lengths), width, *x.shape[2:]))
        return out.index_put((rows, cols), x[0, self.columns(rows, cols)])


def packed_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, where) -> torch.Tensor:
    """The last hidden states [n, H] at the positions ``where`` (rows, columns of the padded batch), from one
    forward of the batch's rows packed into one row (:class:`Packed`)."""
    p = Packed.of(input_ids, attention_mask)
    out = model(
        input_ids=p.input_ids,
        attention_mask=None,
        position_ids=p.position_ids,
        logits_to_keep=NO_LOGITS,
        output_hidden_states=True,
        use_cache=False,
        **segment_kwargs(model, p.bounds),
    )
    return out.hidden_states[-1][0, p.columns(*where)]


def packed_micro_batches(lengths: torch.Tensor, rows: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """``rows`` split into micro-batches of at most ``budget`` tokens (Σ lengths: a packed row has no
    padding), longest first, each sample into the first micro-batch with room; a sample longer than the
    budget is a micro-batch of its own."""
    order = rows[torch.argsort(lengths[rows], descending=True, stable=True)].tolist()
    parts: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        k = next((j for j, r in enumerate(room) if r >= n), None)
        if k is None:
            parts.append([i])
            room.append(budget - n)
        else:
            parts[k].append(i)
            room[k] -= n
    return [torch.tensor(p) for p in parts]


def check_packing(model) -> str | None:
    """Why packed rows cannot serve ``model`` (a transformers model), or None when one packed row of three
    samples (3, 6 and 1 tokens) gives the hidden states of the samples computed alone. Run once at start-up
    with ``learner.compute.packing``: a model whose attention ignores the restarting positions (attention
    across samples) is refused rather than trained on wrong numbers."""
    vocab = model.get_input_embeddings().num_embeddings
    lens = [3, 6, 1]
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = (torch.arange(n) * 5 + 3 * b + 1) % vocab
    attn = (torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]).long()
    device = next(model.parameters()).device
    ids, attn = ids.to(device), attn.to(device)
    where = attn.bool().nonzero(as_tuple=True)
    try:
        with torch.no_grad():
            mine = packed_hidden(model, ids, attn, where).float()
            alone = torch.cat(
                [
                    model(
                        input_ids=ids[b : b + 1, :n],
                        logits_to_keep=NO_LOGITS,
                        output_hidden_states=True,
                        use_cache=False,
                    ).hidden_states[-1][0]
                    for b, n in enumerate(lens)
                ]
            ).float()
    except (RuntimeError, TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    diff = float((mine - alone).abs().max())
    scale = float(alone.abs().max()) or 1.0
    tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    return (
        None if diff <= tol * scale else f"hidden states differ from each sample alone by {diff:.3g} (of {scale:.3g})"
    )
