"""The critic: a value model V(prefix) for ``gae`` and ``vtrace`` (``learner.critic``, docs/learner.md).

A separate model, as verl's critic worker: the trunk of a causal LM (the policy's initial weights, or
``critic.model``) with a scalar head on its last hidden state, trained by its own DeepSpeed engine
(its own learning rate and ZeRO settings) with the clipped value loss. Values use the log-probs'
layout: ``values[:, t]`` is V of the prefix up to position t, the state in which the token at t + 1
was sampled (verl's ``values[:, -response_length - 1:-1]``).

The learner computes the values of the batch it trains before any update (the "old" values of the
clipped loss and of the advantages), then trains the critic on the same micro-batches as the policy.
"""

from __future__ import annotations

import copy

import torch

from learner.config import LearnerConfig
from learner.losses import Normalisers, aggregate
from learner.packing import Packed, segment_kwargs


class ValueModel(torch.nn.Module):
    """``trunk`` (a Hugging Face base model: embeddings, layers, final norm; no LM head) and a linear
    scalar head, initialised to 0 (every value starts at 0: no baseline until it has learned one)."""

    def __init__(self, trunk: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.trunk = trunk
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        **attention,
    ) -> torch.Tensor:
        """Values [B, L-1]: V after each prefix input_ids[:, :t+1] (``position_ids``: a packed row's,
        learner/packing.py, with no ``attention_mask``; ``attention``: its samples' bounds for the attention,
        learner/packing.py ``segment_kwargs``)."""
        hidden = self.trunk(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **attention
        ).last_hidden_state
        return self.head(hidden[:, :-1]).squeeze(-1).float()


def critic_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """The values [B, L-1] of a right-padded batch from ``critic`` (a ValueModel or its engine); with ``packed``
    (learner.compute.packing) from one forward of its rows packed into one row (0 off each row's positions)."""
    if not packed:
        return critic(input_ids, attention_mask)
    p = Packed.of(input_ids, attention_mask)
    trunk = getattr(critic, "module", critic).trunk  # the ValueModel's (critic: it, or its engine)
    bounds = segment_kwargs(trunk, p.bounds)  # the trunk's attention reads them once per forward
    v = critic(p.input_ids, None, p.position_ids, **bounds)  # [1, N-1]: position j of the row predicts token j + 1
    return p.unpack(v[..., None], input_ids.shape[1] - 1)[..., 0]


def build_value_model(policy: torch.nn.Module, cfg: LearnerConfig) -> ValueModel:
    """The critic before its engine: a copy of ``policy``'s trunk (its initial weights), or the trunk of
    the causal LM at ``cfg.critic.model``; with activation checkpointing when the policy has it."""
    if cfg.critic.model is None:
        lm = copy.deepcopy(policy)
    else:
        from transformers import AutoModelForCausalLM

        from learner.model_folder import check_model_folder

        check_model_folder(cfg.critic.model)
        lm = AutoModelForCausalLM.from_pretrained(cfg.critic.model, dtype=torch.float32)
    trunk = lm.base_model  # the LM without its head (Qwen2ForCausalLM.model, LlamaForCausalLM.model, ...)
    if trunk is lm:
        raise ValueError(f"{type(lm).__name__} has no separate trunk (base_model): it cannot be a critic")
    if cfg.compute.gradient_checkpointing:
        trunk.config.use_cache = False
        trunk.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return ValueModel(trunk, lm.config.hidden_size)


def value_loss(
    vpreds: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    mode: str = "token-mean",
    norm: Normalisers | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl ``compute_value_loss``: ½ · aggregate(max((V − R)², (clip(V, V_old ± ε) − R)²)) over ``mask``,
    in every aggregation mode (with ``norm``'s denominators, learner/losses.py). Returns the loss and the
    sums for the diagnostics: ``clipped`` (tokens whose clipped error is the larger: verl's vf_clipfrac
    numerator), ``tokens``."""
    clipped_v = old_values + (vpreds - old_values).clamp(-cliprange_value, cliprange_value)
    err, err_clipped = (vpreds - returns) ** 2, (clipped_v - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(err, err_clipped), mask, mode, norm)
    return loss, {"clipped": float(((err_clipped > err).float() * mask).sum()), "tokens": float(mask.sum())}


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over the masked tokens (verl's ``critic/vf_explained_var``); 0 when the
    returns do not vary (nothing to explain) or there are no tokens."""
    m = mask.bool()
    if int(m.sum()) < 2:
        return 0.0
    r, v = returns[m].double(), values[m].double()
    var = r.var(unbiased=False)
    if float(var) == 0.0:
        return 0.0
    return float(1 - (r - v).var(unbiased=False) / var)
