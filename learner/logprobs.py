"""Log-probs and entropy of the sampling transform, from the final hidden states in chunks of positions.

The generators sample from logits / temperature, then top-k, then top-p, renormalised
(``broker/protocol/sampling.py``); the learner recomputes π_old and π_θ through that same function.
The full-vocabulary logits of a whole batch (positions × vocabulary, and the transform's copies of
them) are never materialised: the model's forward stops at the last hidden states, and the output
head, the transform, the gathered log-prob of the taken token and the entropy run on
``chunk_tokens`` positions at a time; the backward recomputes a chunk's logits (one matmul) instead
of keeping them, and reuses the kept set of top-k/top-p found in the forward, stored in a few numbers
per position (see ``_ChunkLogprobs``). Only completion positions (``positions``) are computed.

A taken token outside the kept set of the transform (top-k/top-p of the current weights, which may
differ from the weights that sampled it) has log-prob −inf: it is reported in ``outside`` and its
log-prob is set to 0 (no gradient), so the loss can mask and count it instead of turning into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from broker.protocol.sampling import sampling_logprobs
from learner.packing import NO_LOGITS, packed_hidden


@dataclass
class TokenLogprobs:
    logp: torch.Tensor  # [B, L-1] log-prob of the token at t+1 (0 off ``positions`` and where outside)
    outside: torch.Tensor  # [B, L-1] bool: the taken token is outside the transform's kept set
    entropy: torch.Tensor | None  # [B, L-1] entropy of the sampling distribution at t (0 off ``positions``)


def _truncates(transform: tuple, vocab: int) -> bool:
    _, top_k, top_p = transform
    return bool(top_k and top_k < vocab) or top_p < 1.0


def _kept_set(z: torch.Tensor, transform: tuple) -> tuple[torch.Tensor, tuple | None]:
    """The sampling distribution's log-probs [n, V] for scaled logits ``z`` (logits / temperature), and
    its kept set stored compactly (None when nothing is cut): per row the smallest kept value v and how
    many tokens equal to v are kept (the first ones by index); for a row whose sort kept other ties,
    the indices of the kept ties. Every token above v is kept: top-k keeps z ≥ its k-th value, top-p a
    prefix of the sorted tokens."""
    logp_all = sampling_logprobs(z, 1.0, *transform[1:])
    if not _truncates(transform, z.shape[-1]):
        return logp_all, None
    kept = torch.isfinite(logp_all)
    v = torch.where(kept, z, torch.full_like(z, float("inf"))).min(-1).values
    c = ((z == v[:, None]) & kept).sum(-1)
    compact = (v, c, {})
    rows = _partial_rows(z, v, c)  # only rows that keep some of their ties can differ from the rebuild
    if len(rows):
        odd = rows[(_rebuild(z, compact)[rows] != kept[rows]).any(-1)].tolist()
        compact[2].update({i: ((z[i] == v[i]) & kept[i]).nonzero().flatten() for i in odd})
    return logp_all, compact


def _partial_rows(z: torch.Tensor, v: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (c < (z == v[:, None]).sum(-1)).nonzero().flatten()


def _rebuild(z: torch.Tensor, compact: tuple | None) -> torch.Tensor | None:
    """The kept set [n, V] from :func:`_kept_set`'s compact form (None: every token)."""
    if compact is None:
        return None
    v, c, odd = compact
    above = z > v[:, None]
    kept = above | (z == v[:, None])
    rows = _partial_rows(z, v, c)
    if len(rows):
        ties = z[rows] == v[rows, None]
        kept[rows] = above[rows] | (ties & (ties.cumsum(-1) <= c[rows, None]))
    for i, tied in odd.items():
        kept[i] = above[i]
        kept[i, tied] = True
    return kept


class _ChunkLogprobs(torch.autograd.Function):
    """Log-prob of the taken token and entropy of the sampling distribution from a chunk's ``logits``
    [n, V], without keeping them: nothing of size n × V is saved for the backward, which recomputes
    ``head(hidden)`` (no autograd; through the module, so ZeRO's hooks gather its weights) and returns
    the gradient of log-softmax over the kept set, found again from the compact form the forward
    stored (no second sort for top-p). The head's own backward stays in the outer graph, so a weight
    used by several chunks (and tied to the embedding) accumulates its gradient once per backward."""

    @staticmethod
    def forward(ctx, logits, hidden, targets, head, transform, entropy):
        logp_all, compact = _kept_set(logits.float() / transform[0], transform)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        outside = torch.isinf(logp)
        logp = logp.masked_fill(outside, 0.0)
        ent = -(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)).sum(-1) if entropy else torch.zeros_like(logp)
        ctx.save_for_backward(hidden, targets, outside, ent)
        ctx.head, ctx.temperature, ctx.compact, ctx.dtype = head, transform[0], compact, logits.dtype
        ctx.mark_non_differentiable(outside)
        ctx.set_materialize_grads(False)
        return logp, ent, outside

    @staticmethod
    def backward(ctx, g_logp, g_ent, _):
        hidden, targets, outside, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None
        with torch.no_grad():
            z = ctx.head(hidden).float() / ctx.temperature
            kept = _rebuild(z, ctx.compact)
            logp_all = torch.log_softmax(z if kept is None else z.masked_fill(~kept, float("-inf")), -1)
            p = logp_all.exp()
            grad = torch.zeros_like(z)
            if g_logp is not None:  # d log p_t / dz_j = [j = t] − p_j (none for a token outside the kept set)
                g = g_logp.float().masked_fill(outside, 0.0)
                grad -= g[:, None] * p
                grad.scatter_add_(-1, targets[:, None], g[:, None])
            if g_ent is not None:  # d H / dz_j = −p_j (log p_j + H)
                grad -= g_ent.float()[:, None] * p * (logp_all.nan_to_num(neginf=0.0) + ent[:, None])
        return (grad / ctx.temperature).to(ctx.dtype), None, None, None, None, None


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    transform: tuple[float, int, float],
    chunk_tokens: int,
    entropy: bool = False,
    shared: SharedPrompts | None = None,
    packed: bool = False,
    sp=None,
) -> TokenLogprobs:
    """Log-probs of each next token at ``positions`` ([B, L-1], 1 where the token at t+1 is trained on)
    under the sampling ``transform`` (temperature, top_k, top_p), for ``model`` (a DeepSpeed engine or a
    Hugging Face causal LM). With ``entropy`` also the sampling distribution's entropy there. With
    ``shared``, each prompt is computed once for the rows that share it (:func:`shared_prompt_hidden`);
    with ``packed``, the rows are packed into one row without padding (learner/packing.py); with ``sp`` (a
    SequenceGroup), that row split over the group's ranks, each computing its positions' log-probs, summed over
    the group (learner/sequence_parallel.py)."""
    where = positions.bool().nonzero(as_tuple=True)
    if sp is not None:
        return _split_token_logprobs(
            model, input_ids, attention_mask, positions, where, transform, chunk_tokens, entropy, sp
        )
    if packed:
        h = packed_hidden(model, input_ids, attention_mask, where)  # [N, H] after the final norm
    elif shared is None:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            logits_to_keep=NO_LOGITS,
            output_hidden_states=True,
            use_cache=False,
        )
        h = out.hidden_states[-1][:, :-1][where]  # [N, H] after the final norm
    else:
        h = shared_prompt_hidden(model, input_ids, shared)[where]
    return _scatter(
        _chunks(model, h, input_ids[:, 1:][where], transform, chunk_tokens, entropy), positions, where, entropy
    )


def _chunks(model, h: torch.Tensor, targets: torch.Tensor, transform, chunk_tokens: int, entropy: bool) -> list:
    """(log-prob, outside, entropy) of the hidden states ``h`` [N, H] predicting ``targets`` [N], in chunks."""
    head = (model.module if hasattr(model, "module") else model).get_output_embeddings()
    parts = []
    for s in range(0, h.shape[0], chunk_tokens):
        hs = h[s : s + chunk_tokens]
        lp, ent, outside = _ChunkLogprobs.apply(
            head(hs), hs.detach(), targets[s : s + chunk_tokens], head, transform, entropy
        )
        parts.append((lp, outside, ent))
    return parts


def _scatter(parts: list, positions: torch.Tensor, where, entropy: bool) -> TokenLogprobs:
    """:func:`_chunks`' results at ``where`` of a [B, L-1] like ``positions`` (0 elsewhere)."""
    device = positions.device

    def scatter(i: int, dtype) -> torch.Tensor:
        values = torch.cat([p[i] for p in parts]) if parts else torch.zeros(0, dtype=dtype, device=device)
        return torch.zeros(positions.shape, dtype=dtype, device=device).index_put(where, values.to(dtype))

    return TokenLogprobs(
        scatter(0, torch.float32), scatter(1, torch.bool), scatter(2, torch.float32) if entropy else None
    )


def _split_token_logprobs(model, input_ids, attention_mask, positions, where, transform, chunk_tokens, entropy, sp):
    """:func:`token_logprobs` of the rows packed into one and split over the sequence-parallel group ``sp``:
    this rank's positions computed here, the whole [B, L-1] summed over the group."""
    from learner.sequence_parallel import sp_hidden, sp_sum

    h, local = sp_hidden(model, input_ids, attention_mask, where, sp)
    mine = tuple(w[local] for w in where)
    parts = _chunks(model, h, input_ids[:, 1:][mine], transform, chunk_tokens, entropy)
    lp = _scatter(parts, positions, mine, entropy)
    # + 0 · Σh: the backward runs through this rank's whole forward even when none of its positions is trained
    # on (a slice of prompt alone): its attention layers' exchanges are collectives the other ranks wait on
    logp = lp.logp + h.sum() * 0.0
    return TokenLogprobs(sp_sum(logp, sp), sp_sum(lp.outside, sp), sp_sum(lp.entropy, sp) if entropy else None)


@dataclass
class SharedPrompts:
    """Which rows of a right-padded batch share their prompt: the samples of one group (collate writes
    the group's prompt, then each sample's completion)."""

    prompt_lens: torch.Tensor  # [B] prompt tokens of each row
    lengths: torch.Tensor  # [B] prompt + completion tokens of each row (the rest is padding)
    groups: torch.Tensor  # [B] rows with the same value share the same prompt


def shared_prompt_hidden(model, input_ids: torch.Tensor, shared: SharedPrompts) -> torch.Tensor:
    """The last hidden states [B, L-1, H] at the positions that predict a completion token (zeros
    elsewhere), each distinct prompt computed once: a group of n samples costs P + n·C tokens of forward
    and backward instead of n·(P + C), the same arithmetic as computing each row whole (causal
    attention: a prompt's states never depend on what follows it), to rounding.

    1. The batch's distinct prompts, left-padded to one width, in one forward that fills a KV cache;
       its last position's hidden state predicts each completion's first token.
    2. The cache's rows are indexed out to the rows that share them (differentiable: the gradient of
       every completion flows back into its prompt's keys and values, summed over the group).
    3. The completions, left-aligned, in a second forward on that cache, at positions that continue
       their prompt's."""
    from transformers import DynamicCache

    from broker.protocol.hfcache import cache_kwarg, transformers_model

    dev = input_ids.device
    B, L = input_ids.shape
    plen, lengths = shared.prompt_lens.to(dev), shared.lengths.to(dev)
    from learner.data import first_of_each

    _, first, which = first_of_each(shared.groups.to(dev))
    P = plen[first]  # [G]
    width = int(P.max())
    src = torch.arange(width, device=dev)[None] - (width - P)[:, None]  # column of row first[g] at slot j
    pattn = (src >= 0).long()
    pids = input_ids[first].gather(1, src.clamp(min=0)) * pattn  # pad slots: token 0, masked out
    cache = DynamicCache(config=transformers_model(model).config)
    kw = {cache_kwarg(model): cache}
    out = model(
        input_ids=pids,
        attention_mask=pattn,
        position_ids=src.clamp(min=0),
        logits_to_keep=NO_LOGITS,
        output_hidden_states=True,
        use_cache=True,
        **kw,
    )
    last = out.hidden_states[-1][:, -1]  # [G, H]: predicts each group's first completion token
    cache.batch_select_indices(which)  # [G, ...] -> [B, ...], row b the cache of its group's prompt
    C = lengths - plen  # completion tokens of each row
    cw = int(C.max())
    j = torch.arange(cw, device=dev)[None]
    cvalid = j < C[:, None]
    cids = input_ids.gather(1, (plen[:, None] + j).clamp(max=L - 1)) * cvalid
    out = model(
        input_ids=cids,
        attention_mask=torch.cat([pattn[which], cvalid.long()], dim=1),
        position_ids=plen[:, None] + j,
        logits_to_keep=NO_LOGITS,
        output_hidden_states=True,
        use_cache=True,
        **kw,
    )
    # slot j predicts completion token j: the prompt's last state, then the completion's own states
    seq = torch.cat([last[which][:, None], out.hidden_states[-1][:, :-1]], dim=1)  # [B, cw, H]
    rows, cols = cvalid.nonzero(as_tuple=True)
    hidden = seq.new_zeros((B, L - 1, seq.shape[-1]))
    return hidden.index_put((rows, plen[rows] - 1 + cols), seq[rows, cols])


def check_output_head(model) -> None:
    """Fail at start-up, with a clear message, for a model whose logits are not its output head applied
    to its last hidden state (a final soft-cap or logit scale, say): chunked log-probs would be wrong."""
    ids = torch.arange(1, 5)[None] % model.get_input_embeddings().num_embeddings
    with torch.no_grad():
        full = model(input_ids=ids).logits.float()
        hidden = model(input_ids=ids, logits_to_keep=NO_LOGITS, output_hidden_states=True).hidden_states[-1]
        mine = model.get_output_embeddings()(hidden).float()
    if mine.shape != full.shape or not torch.allclose(mine, full, rtol=1e-4, atol=1e-4):
        raise ValueError(
            f"{type(model).__name__}: its logits are not lm_head(last hidden state) (a soft-cap or "
            "logit scale?); the learner's chunked log-probs do not support this model yet"
        )


def check_shared_prompt(model) -> str | None:
    """Why the shared-prompt forward cannot serve ``model`` (a transformers model), or None when it gives
    the hidden states of whole rows on a small batch (two groups of two, prompts of 3 and 5 tokens). Run
    once at start-up: a model whose KV cache cannot be indexed by row or continued from (a cache type
    transformers builds differently, say) falls back to whole rows instead of training on wrong numbers."""
    vocab = model.get_input_embeddings().num_embeddings
    lens, plens = [5, 4, 7, 8], [3, 3, 5, 5]
    ids = torch.zeros(4, 8, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = (torch.arange(n) * 7 + 3 * b + (b // 2) * 11 + 1) % vocab
    ids[1, :3] = ids[0, :3]
    ids[3, :5] = ids[2, :5]
    attn = (torch.arange(8)[None] < torch.tensor(lens)[:, None]).long()
    shared = SharedPrompts(torch.tensor(plens), torch.tensor(lens), torch.tensor([0, 0, 1, 1]))
    try:
        with torch.no_grad():
            mine = shared_prompt_hidden(model, ids, shared)
            whole = model(
                input_ids=ids, attention_mask=attn, logits_to_keep=NO_LOGITS, output_hidden_states=True, use_cache=False
            ).hidden_states[-1][:, :-1]
    except Exception as e:  # noqa: BLE001 - reported: the learner computes whole rows instead
        return f"{type(e).__name__}: {e}"
    rows = torch.cat([torch.full((n - p,), b) for b, (n, p) in enumerate(zip(lens, plens))])
    cols = torch.cat([torch.arange(p - 1, n - 1) for n, p in zip(lens, plens)])
    diff = float((mine[rows, cols].float() - whole[rows, cols].float()).abs().max())
    scale = float(whole[rows, cols].float().abs().max()) or 1.0
    tol = 1e-3 if whole.dtype == torch.float32 else 5e-2
    return None if diff <= tol * scale else f"hidden states differ from whole rows by {diff:.3g} (of {scale:.3g})"


def batch_logprobs(
    model,
    mb,
    transform: tuple,
    chunk_tokens: int,
    entropy: bool = False,
    shared: bool = False,
    packed: bool = False,
    sp=None,
) -> TokenLogprobs:
    """:func:`token_logprobs` of a learner/data.py ``Batch`` ``mb``: of its loss tokens; with ``shared``
    (learner.compute.shared_prompt), each group's prompt computed once; with ``packed``
    (learner.compute.packing, which takes precedence), its rows packed into one; with ``sp``
    (learner.compute.sequence_parallel), that row split over the ranks of a sequence-parallel group."""
    rows = SharedPrompts(mb.prompt_lens, mb.lengths, mb.groups) if shared and mb.prompt_lens is not None else None
    return token_logprobs(
        model, mb.input_ids, mb.attention_mask, mb.loss_mask, transform, chunk_tokens, entropy, rows, packed, sp
    )
