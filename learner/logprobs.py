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

NO_LOGITS = torch.empty(0, dtype=torch.long)  # logits_to_keep: the forward computes no logits at all


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
) -> TokenLogprobs:
    """Log-probs of each next token at ``positions`` ([B, L-1], 1 where the token at t+1 is trained on)
    under the sampling ``transform`` (temperature, top_k, top_p), for ``model`` (a DeepSpeed engine or a
    Hugging Face causal LM). With ``entropy`` also the sampling distribution's entropy there."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        logits_to_keep=NO_LOGITS,
        output_hidden_states=True,
        use_cache=False,
    )
    hidden = out.hidden_states[-1][:, :-1]  # [B, L-1, H] after the final norm
    head = (model.module if hasattr(model, "module") else model).get_output_embeddings()
    where = positions.bool().nonzero(as_tuple=True)
    h, targets = hidden[where], input_ids[:, 1:][where]  # [N, H], [N]
    parts = []
    for s in range(0, h.shape[0], chunk_tokens):
        hs = h[s : s + chunk_tokens]
        lp, ent, outside = _ChunkLogprobs.apply(
            head(hs), hs.detach(), targets[s : s + chunk_tokens], head, transform, entropy
        )
        parts.append((lp, outside, ent))
    shape = positions.shape

    def scatter(i: int, dtype) -> torch.Tensor:
        values = torch.cat([p[i] for p in parts]) if parts else torch.zeros(0, dtype=dtype, device=input_ids.device)
        return torch.zeros(shape, dtype=dtype, device=input_ids.device).index_put(where, values.to(dtype))

    return TokenLogprobs(
        scatter(0, torch.float32), scatter(1, torch.bool), scatter(2, torch.float32) if entropy else None
    )


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


def batch_logprobs(model, mb, transform: tuple, chunk_tokens: int, entropy: bool = False) -> TokenLogprobs:
    """:func:`token_logprobs` of a learner/data.py ``Batch`` ``mb``: of its loss tokens."""
    return token_logprobs(model, mb.input_ids, mb.attention_mask, mb.loss_mask, transform, chunk_tokens, entropy)
