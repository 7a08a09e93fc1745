"""How a transformers model takes its KV cache, shared by the generators' torch backend (which decodes
with it) and the learner (whose shared-prompt forward computes a group's prompt once and hands its cache
to the group's completions)."""

from __future__ import annotations

import inspect


def transformers_model(model):
    """The transformers model inside ``model``: a DeepSpeed engine's ``module``, a peft model's base model,
    the learner's LoRA reference (learner/lora.py ``AdapterDisabled``: the peft model with adapters off)."""
    model = getattr(model, "peft_model", model)  # the LoRA reference
    model = getattr(model, "module", model)  # a DeepSpeed engine's model
    if hasattr(model, "get_base_model"):  # a peft model: the transformers model it wraps
        model = model.get_base_model()
    return model


def cache_kwarg(model) -> str:
    """The keyword a transformers model's ``forward`` takes its KV cache by: ``cache`` from transformers
    5.2x (where ``past_key_values`` is a deprecated alias that warns on every call: one ``FutureWarning``
    per decode step in a generator's log), ``past_key_values`` before. ``model`` may be a DeepSpeed
    engine or a peft wrapper: the transformers model inside decides (:func:`transformers_model`)."""
    model = transformers_model(model)
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
