"""LoRA in the learner (``learner.lora``; docs/learner.md, "LoRA").

With ``learner.lora.rank`` > 0 the policy is wrapped by peft: every base weight is frozen and low-rank
adapters (A: r × in, B: out × r, B zero at the start, so the first version is the base model) are added
to the target modules. Only the adapters are trained, so the optimizer's state and the gradients are
the adapters' size, and only they are checkpointed (the base is loaded again from ``learner.model``
on resume). The reference policy of the KL term is the same model with its adapters disabled
(:class:`AdapterDisabled`): no second copy of the weights.

Publication (``learner.lora.publish``):

- ``adapter`` (the default with the store and http transports): each version holds the adapter alone, in
  PEFT's layout (:func:`adapter_state`: ``adapter_model.safetensors`` with
  ``base_model.model.<module>.lora_A.weight`` / ``lora_B``, and ``adapter_config.json``), a few MB. The
  first version a learner process publishes also carries the base model's weights (:func:`base_state`,
  under its own names), and every announcement pins that base (``base``, ``base_digest``): generators
  load the base once and then only adapters (docs/weights.md, "LoRA adapters").
- ``merged`` (the collective transport's): each version is the merged model (:func:`merged_state_dict`:
  W + (alpha / r) B A under the base model's own tensor names), served as a fully trained version is.
"""

from __future__ import annotations

import torch

from broker.protocol.weightstore import PEFT_PREFIX
from learner.config import LoraConfig

# peft's PeftModel names every tensor of the wrapped model under PEFT_PREFIX, and a wrapped layer's own weight
# under <module>.base_layer.weight
BASE_LAYER = ".base_layer"
PARTS = ("lora_A", "lora_B")


def apply_lora(model: torch.nn.Module, cfg: LoraConfig):
    """``model`` wrapped by peft with fresh adapters on ``cfg.target_modules`` (the base frozen).
    ValueError naming the modules when none of them is in the model."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = cfg.target_modules
    config = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        bias="none",
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as e:
        raise ValueError(f"learner.lora.target_modules {targets!r}: {e}") from e
    if getattr(model.config, "tie_word_embeddings", False) and isinstance(targets, list) and "lm_head" in targets:
        raise ValueError("learner.lora.target_modules: lm_head is tied to the embeddings in this model; leave it out")
    return wrapped


def scaling(cfg: LoraConfig) -> float:
    """The factor of the adapters' product in the merged weight: alpha / r (peft's default scaling)."""
    return cfg.alpha / cfg.rank


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """A PeftModel's state dict (``state``: peft's names, e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``)
    as (the base model's tensors under the names the unwrapped model uses,
    ``model.layers.0.self_attn.q_proj.weight``; {module: {"lora_A": A, "lora_B": B}}). No copies.
    ValueError for a module with one factor only."""
    base: dict[str, torch.Tensor] = {}
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        name = k.removeprefix(PEFT_PREFIX)
        for part in PARTS:
            marker = f".{part}."
            if marker in name:  # <module>.lora_A.<adapter>.weight
                adapters.setdefault(name.split(marker)[0], {})[part] = v
                break
        else:
            base[name.replace(BASE_LAYER + ".", ".")] = v
    for module, ab in adapters.items():
        if set(ab) != set(PARTS):
            raise ValueError(f"{module}: an adapter needs both lora_A and lora_B (found {sorted(ab)})")
    return base, adapters


def base_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frozen base model's tensors of a PeftModel's state dict, under the base model's own names."""
    return split_state(state)[0]


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a PeftModel's state dict in PEFT's file layout (what ``save_pretrained`` writes into
    ``adapter_model.safetensors``, what vLLM and peft load): ``base_model.model.<module>.lora_A.weight``."""
    return {
        f"{PEFT_PREFIX}{module}.{part}.weight": t
        for module, ab in split_state(state)[1].items()
        for part, t in ab.items()
    }


def adapter_publication(state: dict[str, torch.Tensor], with_base: bool) -> dict[str, torch.Tensor]:
    """What a version published as its adapter alone holds (learner.lora.publish = adapter), from a PeftModel's
    state dict: the adapter (:func:`adapter_state`), and with ``with_base`` the base model's tensors too
    (:func:`base_state`; the first version of a learner process, ``Publisher.needs_base``)."""
    adapter = adapter_state(state)
    return {**base_state(state), **adapter} if with_base else adapter


def adapter_config(peft_model) -> dict:
    """The model's ``adapter_config.json`` (PEFT's format), its target modules given by their leaf names
    (``q_proj``, ...: the form vLLM reads), so that any engine can rebuild the same adapters."""
    d = peft_model.peft_config["default"].to_dict()
    targets = d["target_modules"]
    leaves = sorted({t.rsplit(".", 1)[-1] for t in ([targets] if isinstance(targets, str) else targets)})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": d["r"],
        "lora_alpha": d["lora_alpha"],
        "lora_dropout": d["lora_dropout"],
        "target_modules": leaves,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": "",
        "inference_mode": True,
    }


def merged_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapter merged into its layer, from a PeftModel's state dict
    (:func:`split_state`): ``W + scale · B A`` (computed in float32, then in W's dtype) under the name the
    unwrapped model uses. Tensors without an adapter are passed through as they are (no copy)."""
    out, adapters = split_state(state)
    for module, ab in adapters.items():
        w = out.get(f"{module}.weight")
        if w is None:
            raise ValueError(f"{module}: an adapter without its base weight")
        delta = ab["lora_B"].float() @ ab["lora_A"].float()
        if delta.shape != w.shape:
            raise ValueError(
                f"{module}: adapter product {tuple(delta.shape)} does not match the weight {tuple(w.shape)}"
            )
        out[f"{module}.weight"] = (w.float() + scale * delta).to(w.dtype)
    return out


class AdapterDisabled:
    """The reference policy under LoRA: calls the trained model with its adapters disabled (the base
    model, frozen since the start), through the same weights in memory."""

    def __init__(self, peft_model):
        self.peft_model = peft_model

    def __call__(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    def get_output_embeddings(self):
        return self.peft_model.get_output_embeddings()

    def get_input_embeddings(self):
        return self.peft_model.get_input_embeddings()
