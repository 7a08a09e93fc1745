"""The torch backend's batched sampler: a group's prompt prefilled once, then one forward per new token
for the rows still sampling (docs/generators.md, "The torch backend's decode loop").

Row ``i * n + j`` of a batch is sample j of prompt i. The KV cache is ours, filled in place by every
forward (never read back from the output, whose field name also changed across transformers versions).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import DynamicCache

from broker.protocol.hfcache import cache_kwarg
from broker.protocol.sampling import sample, sampling_logprobs
from generators.backends.base import Completion, StepHook
from generators.config import SamplingConfig


class Prefilled(NamedTuple):
    """A batch after its prompts' forward: the cache and the model's keyword for it (``kv``), the next
    token's logits, the attention mask and next position of each of the B = prompts x n rows."""

    kv: dict
    logits: torch.Tensor
    attn: torch.Tensor
    next_pos: torch.Tensor


class Sampled(NamedTuple):
    """Per row (B): tokens and their log-probs [B, max_tokens] (valid up to ``lengths``), whether the row
    ended on EOS; per token position, the version of the forward pass that gave its logits."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    stopped: torch.Tensor
    lengths: torch.Tensor
    versions: list[int]


def prefill(model, prompts: list[list[int]], n: int, pad_id: int, device: torch.device) -> Prefilled:
    """One forward of the left-padded prompts (the logits of their last position only, where the model
    takes ``logits_to_keep``), then each prompt's KV cache copied to the n rows of its group."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, P - len(p) :] = torch.tensor(p)
        attn[i, P - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    past = DynamicCache(config=model.config)
    kv = {cache_kwarg(model): past}
    last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **kv, **last)
    if n > 1:
        past.batch_repeat_interleave(n)
    attn, pos = attn.repeat_interleave(n, dim=0), pos.repeat_interleave(n, dim=0)
    return Prefilled(kv, out.logits[:, -1].repeat_interleave(n, dim=0), attn, pos[:, -1] + 1)


def decode(
    model,
    batch: Prefilled,
    sampling: SamplingConfig,
    gen: torch.Generator,
    eos_id: int,
    pad_id: int,
    tick: Callable[[], None],
    on_step: StepHook | None = None,
    version: int = -1,
) -> Sampled:
    """Sample up to ``sampling.max_tokens`` tokens per row, ``tick()`` before each step; ``on_step()`` (the
    in-flight hook) between steps returns the version the next step's forward uses.

    The decode batch holds the rows still sampling (``rows``: their index in the result). A finished row
    is dropped from it, and from the KV cache, once a quarter of the batch has finished: a step costs what
    its live rows cost, and the cache is compacted a few times per batch, not once per row."""
    kv, logits, attn, next_pos = batch
    past = next(iter(kv.values()))
    B, T = attn.shape[0], sampling.max_tokens
    device = attn.device
    tokens = torch.zeros((B, T), dtype=torch.long, device=device)
    lps = torch.zeros((B, T), device=device)
    stopped = torch.zeros(B, dtype=torch.bool, device=device)  # row i ended on the EOS token
    lengths = torch.full((B,), T, dtype=torch.long, device=device)
    versions = [version] * T  # version of the forward pass that gave token t's logits
    rows = torch.arange(B, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)  # per row of the decode batch
    for t in range(T):
        tick()
        logp = sampling_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        tok = sample(logp, gen)
        tokens[rows, t] = tok
        lps[rows, t] = logp.gather(-1, tok[:, None]).squeeze(-1)
        just_done = (~done) & (tok == eos_id)
        lengths[rows[just_done]] = t + 1
        stopped[rows[just_done]] = True
        done |= just_done
        if bool(done.all()) or t == T - 1:
            break
        if 4 * int(done.sum()) >= len(rows):
            keep = (~done).nonzero().squeeze(-1)
            past.batch_select_indices(keep)
            rows, done, tok, attn, next_pos = rows[keep], done[keep], tok[keep], attn[keep], next_pos[keep]
        tok = tok.masked_fill(done, pad_id)
        attn = torch.cat([attn, (~done).long()[:, None]], dim=1)
        if on_step is not None:  # a new version may load here: the next token's logits use it (the KV
            version = on_step()  # cache of earlier tokens stays as the old weights computed it)
            versions[t + 1 :] = [version] * (T - t - 1)
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None], use_cache=True, **kv)
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    return Sampled(tokens.cpu(), lps.cpu(), stopped.cpu(), lengths.cpu(), versions)


def grouped(s: Sampled, n: int, with_versions: bool) -> list[list[Completion]]:
    """The completions of each prompt (n per group, in row order)."""
    result: list[list[Completion]] = []
    for i in range(len(s.lengths)):
        L = int(s.lengths[i])
        c = Completion(
            s.tokens[i, :L].tolist(),
            s.logprobs[i, :L].tolist(),
            "stop" if bool(s.stopped[i]) else "length",
            s.versions[:L] if with_versions else None,
        )
        if i % n == 0:
            result.append([])
        result[-1].append(c)
    return result
