"""The learner's models, built once at start-up: the policy's DeepSpeed engine, and the roles beside it
that verl gives workers of their own: the reference (the initial weights, frozen, for the KL terms) and
the critic (a value model with its own engine, learner/critic.py); LoRA adapters when configured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from learner.config import LearnerConfig
from learner.engine import build_engine, load_model
from broker.runtime.config import ConfigError
from learner.logprobs import check_output_head, check_shared_prompt
from learner.packing import check_packing, use_packed_attention

log = logging.getLogger("relay.learner")


@dataclass
class Policy:
    engine: object  # the policy's DeepSpeed engine
    critic: object | None  # the critic's engine (learner.critic.enabled)
    reference: object | None  # the frozen reference (kl_coef > 0): a copy, or the LoRA base with adapters off
    model: torch.nn.Module  # the policy's module (its config names the published folder's architecture)
    tokenizer: object
    pad_id: int
    vocab: int
    shared_prompt: bool  # learner.compute.shared_prompt, where the model passed the start-up check
    lora_scale: float | None  # learner.lora: the adapters' scale; None without LoRA


def _check_packing(model, cfg: LearnerConfig, leader: bool) -> None:
    """learner.compute.packing: the model's SDPA made one call per packed sample (learner/packing.py
    ``packed_attention``; where it applies), then refuse a model whose attention crosses the packed samples'
    boundaries; say once that it replaces the shared-prompt forward."""
    per_sample = use_packed_attention(model)
    why = check_packing(model)
    if why is not None:
        attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise ConfigError(
            f"learner.compute.packing: {type(model).__name__} with attention {attention!r} does not keep packed "
            f"samples apart ({why}); set learner.compute.packing = false"
        )
    if leader:
        log.info(
            "learner.compute.packing: attention %s",
            "one SDPA call per packed sample (relay_packed)" if per_sample else "the model's own, with its mask",
        )
    if leader and cfg.compute.shared_prompt:
        log.info(
            "learner.compute.packing: each micro-batch is one packed row; learner.compute.shared_prompt is off "
            "(packing takes precedence: each sample's prompt is computed in its own segment)"
        )


def _split_attention(model, cfg: LearnerConfig, leader: bool) -> None:
    """learner.compute.sequence_parallel: the model's attention made Ulysses' (learner/sequence_parallel.py),
    after every rank of its group checked, together, that the split gives the model's numbers; refused
    otherwise."""
    from learner.sequence_parallel import ATTENTION, check_sequence_parallel, sequence_group

    k = cfg.compute.sequence_parallel
    sp = sequence_group(dist.get_rank(), dist.get_world_size(), k)
    why = check_sequence_parallel(model, sp)
    if why is not None:
        raise ConfigError(
            f"learner.compute.sequence_parallel = {k}: the attention of {type(model).__name__} cannot be split over "
            f"{k} ranks ({why}); set learner.compute.sequence_parallel = 1, or a k that divides its key-value "
            "heads (docs/learner.md)"
        )
    if leader:
        log.info(
            "learner.compute.sequence_parallel = %d: each micro-batch one packed row split over %d ranks (attention "
            "%s, an all-to-all over heads); %d data-parallel group(s)",
            k,
            k,
            ATTENTION,
            sp.dp,
        )


def build_policy(cfg: LearnerConfig, leader: bool) -> Policy:
    """Every rank builds the same models (the leader first builds the tiny model's folder)."""
    if leader or cfg.model != "tiny":
        model, tokenizer = load_model(cfg)
    dist.barrier()  # the leader built the tiny model's folder
    if not leader and cfg.model == "tiny":
        model, tokenizer = load_model(cfg, build=False)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    vocab = model.get_input_embeddings().num_embeddings
    check_output_head(model)  # chunked log-probs need logits = lm_head(last hidden state)
    k = cfg.compute.sequence_parallel
    if k > 1:
        _split_attention(model, cfg, leader)
    elif cfg.compute.packing:
        _check_packing(model, cfg, leader)
    shared = (
        cfg.compute.shared_prompt
        and k == 1
        and not cfg.compute.packing
        and not cfg.compute.gradient_checkpointing
        and not cfg.critic.enabled
    )
    why = check_shared_prompt(model) if shared else None
    if why is not None:
        shared = False
        log.warning("learner.compute.shared_prompt: off for this model, every sample computed whole (%s)", why)
    critic = None  # verl's critic worker: a value model with its own engine (learner/critic.py)
    if cfg.critic.enabled:
        from learner.critic import build_value_model

        critic = build_value_model(model, cfg)  # before the policy's engine: from its initial weights
    lora_scale = None  # learner.lora: adapters trained, each version the adapter or the merged model (learner/lora.py)
    reference = None  # the role of verl's reference worker: the initial weights, frozen
    if cfg.lora.rank:
        from learner.lora import AdapterDisabled, apply_lora, scaling

        model = apply_lora(model, cfg.lora)
        lora_scale = scaling(cfg.lora)
        if leader:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            log.info(
                "LoRA rank %d on %s: %d of %d parameters trained (%.2f%%)",
                cfg.lora.rank,
                cfg.lora.target_modules,
                trainable,
                total,
                100 * trainable / total,
            )
        if cfg.regularization.kl_coef > 0:
            reference = AdapterDisabled(model)  # the base: the same weights, adapters off (no copy)
    elif cfg.regularization.kl_coef > 0:
        import copy

        reference = copy.deepcopy(model).eval().requires_grad_(False)
    engine = build_engine(model, cfg)
    if isinstance(reference, torch.nn.Module):
        reference.to(engine.device)
    critic = build_engine(critic, cfg, critic=True) if critic is not None else None
    return Policy(engine, critic, reference, model, tokenizer, pad_id, vocab, shared, lora_scale)
