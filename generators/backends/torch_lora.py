"""LoRA adapters in the torch backend (generators/backends/torch.py): an adapter published alone
(learner.lora.publish) is added to the model once by peft, then loaded into those same adapter
parameters, version after version; the forward computes W x + (alpha / r) B A x, as the learner's does."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from broker.protocol.weightstore import ADAPTER_CONFIG, ADAPTER_SETTINGS, PEFT_PREFIX, Verified, is_adapter_tensor


def _adapter_param(file_name: str) -> str:
    """An adapter file's tensor name -> the parameter peft gave the model (the adapter named ``default``)."""
    module, part = file_name.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0], file_name.rsplit(".", 2)[1]
    return f"{module}.{part}.default.weight"


def base_layer_name(name: str) -> str:
    """``<module>.weight`` -> ``<module>.base_layer.weight``: where a layer with an adapter keeps its own weight."""
    module, leaf = name.rsplit(".", 1)
    return f"{module}.base_layer.{leaf}"


def adapter_settings(path: str, verified: Verified | None, served: dict | None) -> dict:
    """The LoRA settings of version ``path``'s adapter (PEFT's adapter_config.json); ValueError when they are
    not supported, or differ from those of the adapter the model serves (``served``; None: none yet)."""
    settings = json.loads(
        verified.blobs[ADAPTER_CONFIG] if verified is not None else (Path(path) / ADAPTER_CONFIG).read_bytes()
    )
    wanted = {k: settings.get(k) for k in ADAPTER_SETTINGS}
    if settings.get("use_dora") or settings.get("modules_to_save") or settings.get("bias", "none") != "none":
        raise ValueError(f"{path}: DoRA, modules_to_save and adapter biases are not supported")
    if served is not None and wanted != served:
        raise ValueError(f"{path}: adapter settings {wanted} differ from those of the adapter served {served}")
    return wanted


def attach_adapter(model, wanted: dict, path: str) -> None:
    """Add LoRA adapters with the settings ``wanted`` to the model (peft), once: the first adapter's."""
    from peft import LoraConfig, inject_adapter_in_model

    # from_pretrained of a folder with an adapter_config.json (load) attached its adapter already (transformers
    # does so by itself): injecting a second time would stack peft's layers; copy_adapter fills them either way
    if not getattr(model, "_hf_peft_config_loaded", False):
        try:
            inject_adapter_in_model(
                LoraConfig(
                    r=wanted["r"],
                    lora_alpha=wanted["lora_alpha"],
                    lora_dropout=0.0,
                    target_modules=wanted["target_modules"],
                    bias="none",
                ),
                model,
            )
        except ValueError as e:
            raise ValueError(f"{path}: the adapter does not fit the model: {e}") from e
    model.requires_grad_(False).eval()


def copy_adapter(model, tensors: dict[str, torch.Tensor], path: str) -> None:
    """Copy an adapter file's tensors into the model's adapters in place. All or nothing: ValueError, the
    model unchanged, when they are not exactly one A and one B per adapted layer, with their shapes."""
    own = {k: p for k, p in model.named_parameters() if is_adapter_tensor(k)}
    renamed = {_adapter_param(k): v for k, v in tensors.items()}
    missing = sorted(set(own) - set(renamed))
    unexpected = sorted(set(renamed) - set(own))
    wrong = [k for k in renamed if k in own and tuple(renamed[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{path}: adapter tensors do not match the model's adapters: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]}"
        )
    with torch.no_grad():
        for k, t in renamed.items():
            own[k].copy_(t)
