"""Log-probs and entropy of the sampling transform, from the final hidden states in chunks of positions.

The generators sample from logits / temperature, then top-k, then top-p, renormalised
(``broker/protocol/sampling.py``); the learner recomputes π_old and π_θ through that same function.
The full-vocabulary logits of a whole batch (positions × vocabulary, and the transform's copies of
them) are never materialised: the model's forward stops at the last hidden states, and the output
head, the transform, the gathered log-prob of the taken token and the entropy run on
``chunk_tokens`` positions at a time, inside ``torch.utils.checkpoint`` so the backward recomputes a
chunk's logits instead of keeping them. Only completion positions (``positions``) are computed.

A taken token outside the kept set of the transform (top-k/top-p of the current weights, which may
differ from the weights that sampled it) has log-prob −inf: it is reported in ``outside`` and its
log-prob is set to 0 (no gradient), so the loss can mask and count it instead of turning into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from broker.protocol.sampling import sampling_logprobs

NO_LOGITS = torch.empty(0, dtype=torch.long)  # logits_to_keep: the forward computes no logits at all


@dataclass
class TokenLogprobs:
    logp: torch.Tensor               # [B, L-1] log-prob of the token at t+1 (0 off ``positions`` and where outside)
    outside: torch.Tensor            # [B, L-1] bool: the taken token is outside the transform's kept set
    entropy: torch.Tensor | None     # [B, L-1] entropy of the sampling distribution at t (0 off ``positions``)


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, transform: tuple,
           entropy: bool) -> tuple[torch.Tensor, ...]:
    all_logp = sampling_logprobs(head(hidden), *transform)            # [n, V], -inf outside the kept set
    logp = all_logp.gather(-1, targets[:, None]).squeeze(-1)
    outside = torch.isinf(logp)
    logp = torch.where(outside, torch.zeros_like(logp), logp)
    if not entropy:
        return logp, outside
    kept = torch.isfinite(all_logp)  # p log p = 0 outside the kept set (and no 0 · inf in the backward)
    ent = -(all_logp.exp() * torch.where(kept, all_logp, torch.zeros_like(all_logp))).sum(-1)
    return logp, outside, ent


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                   transform: tuple[float, int, float], chunk_tokens: int, entropy: bool = False) -> TokenLogprobs:
    """Log-probs of each next token at ``positions`` ([B, L-1], 1 where the token at t+1 is trained on)
    under the sampling ``transform`` (temperature, top_k, top_p), for ``model`` (a DeepSpeed engine or a
    Hugging Face causal LM). With ``entropy`` also the sampling distribution's entropy there."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=NO_LOGITS,
                output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states[-1][:, :-1]                          # [B, L-1, H] after the final norm
    head = (model.module if hasattr(model, "module") else model).get_output_embeddings()
    where = positions.bool().nonzero(as_tuple=True)
    h, targets = hidden[where], input_ids[:, 1:][where]               # [N, H], [N]
    parts = []
    for s in range(0, h.shape[0], chunk_tokens):
        args = (head, h[s:s + chunk_tokens], targets[s:s + chunk_tokens], transform, entropy)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk(*args))
    shape = positions.shape

    def scatter(i: int, dtype) -> torch.Tensor:
        values = torch.cat([p[i] for p in parts]) if parts else torch.zeros(0, dtype=dtype, device=input_ids.device)
        return torch.zeros(shape, dtype=dtype, device=input_ids.device).index_put(where, values.to(dtype))

    return TokenLogprobs(scatter(0, torch.float32), scatter(1, torch.bool), scatter(2, torch.float32) if entropy else None)


def check_output_head(model) -> None:
    """Fail at start-up, with a clear message, for a model whose logits are not its output head applied
    to its last hidden state (a final soft-cap or logit scale, say): chunked log-probs would be wrong."""
    ids = torch.arange(1, 5)[None] % model.get_input_embeddings().num_embeddings
    with torch.no_grad():
        full = model(input_ids=ids).logits.float()
        hidden = model(input_ids=ids, logits_to_keep=NO_LOGITS, output_hidden_states=True).hidden_states[-1]
        mine = model.get_output_embeddings()(hidden).float()
    if mine.shape != full.shape or not torch.allclose(mine, full, rtol=1e-4, atol=1e-4):
        raise ValueError(f"{type(model).__name__}: its logits are not lm_head(last hidden state) (a soft-cap or "
                         "logit scale?); the learner's chunked log-probs do not support this model yet")
