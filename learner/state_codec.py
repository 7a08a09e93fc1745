"""Nested training state (an optimizer's ``state_dict``, DeepSpeed's ZeRO partitions) as JSON plus
named tensors, without pickle.

``encode(obj)`` walks dicts, lists and tuples and returns ``(tree, tensors)``: ``tree`` is plain JSON in
which every tensor is replaced by ``{"$tensor": name}`` (``tensors[name]`` holds it, to be written with
safetensors), and the values JSON has no form for are tagged:

- ``{"$tuple": [...]}`` a tuple (torch's ``betas``);
- ``{"$dict": [[key, value], ...]}`` a dict whose keys are not all strings (optimizer state by index);
- ``{"$float": "nan" | "inf" | "-inf"}`` a non-finite float (the file stays strict JSON);
- ``{"$dtype": "bfloat16"}`` a ``torch.dtype``;
- ``{"$enum": NAME, "value": v}`` and ``{"$object": NAME, "fields": {...}}`` for the few DeepSpeed
  types its optimizers put in their state (``ZeroStageEnum``, loss scalers, ``fragment_address``),
  named in ``_known_types``; an object is rebuilt from its fields, never by running stored code.

Anything else (another class, a function, a set, bytes) raises ``StateCodecError`` naming where in
the structure it sits, so an unsupported optimizer fails at its first checkpoint, not at resume.
``decode(tree, tensors)`` is the inverse: ``decode(*encode(x))`` equals ``x`` (tensors bit for bit,
dtype and shape kept; OrderedDicts come back as dicts).
"""

from __future__ import annotations

import enum
import math
from typing import Any

import torch

TAG = "$"


class StateCodecError(ValueError):
    pass


def _known_types() -> dict[str, type]:
    """The non-builtin types allowed in stored state, by the name written to the file."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return {
        "ZeroStageEnum": ZeroStageEnum,
        "LossScaler": LossScaler,
        "DynamicLossScaler": DynamicLossScaler,
        "fragment_address": fragment_address,
    }


def _type_name(obj: Any, where: str) -> str:
    for name, cls in _known_types().items():
        if type(obj) is cls:
            return name
    raise StateCodecError(
        f"cannot store {where} in a checkpoint: a {type(obj).__module__}.{type(obj).__qualname__} "
        f"(checkpoints hold tensors, numbers, strings, lists, tuples, dicts, dtypes and the "
        f"DeepSpeed types {sorted(_known_types())}; no pickle)"
    )


def encode(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``obj`` as (JSON tree, tensors by name)."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[tuple[str, int]] = set()

    def enc(o: Any, where: str) -> Any:
        if o is None or isinstance(o, (bool, str)) or (isinstance(o, int) and not isinstance(o, enum.Enum)):
            return o
        if isinstance(o, float):
            return o if math.isfinite(o) else {f"{TAG}float": repr(o)}
        if torch.is_tensor(o):
            t = o.detach().to("cpu").contiguous()
            ptr = (str(t.device), t.untyped_storage().data_ptr())
            if ptr in storages:  # safetensors refuses tensors sharing memory: store a copy
                t = t.clone()
            storages.add(ptr)
            name = f"{len(tensors)}:{where}"
            tensors[name] = t
            return {f"{TAG}tensor": name}
        if isinstance(o, torch.dtype):
            return {f"{TAG}dtype": str(o).removeprefix("torch.")}
        if isinstance(o, tuple) and not hasattr(o, "_fields"):
            return {f"{TAG}tuple": [enc(v, f"{where}.{i}") for i, v in enumerate(o)]}
        if isinstance(o, list):
            return [enc(v, f"{where}.{i}") for i, v in enumerate(o)]
        if isinstance(o, dict):
            if all(isinstance(k, str) for k in o):
                if any(k.startswith(TAG) for k in o):
                    raise StateCodecError(
                        f"cannot store {where} in a checkpoint: its key "
                        f"{next(k for k in o if k.startswith(TAG))!r} starts with {TAG!r}"
                    )
                return {k: enc(v, f"{where}.{k}") for k, v in o.items()}
            return {f"{TAG}dict": [[enc(k, f"{where}.<key>"), enc(v, f"{where}.{k}")] for k, v in o.items()]}
        if isinstance(o, enum.Enum):
            return {f"{TAG}enum": _type_name(o, where), "value": o.value}
        name = _type_name(o, where)
        return {f"{TAG}object": name, "fields": enc(dict(vars(o)), f"{where}.<{name}>")}

    return enc(obj, "state"), tensors


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The structure ``encode`` flattened into ``tree`` and ``tensors``."""
    known = None

    def cls(name: str) -> type:
        nonlocal known
        known = known or _known_types()
        if name not in known:
            raise StateCodecError(f"checkpoint names an unknown type {name!r} (known: {sorted(known)})")
        return known[name]

    def dec(o: Any) -> Any:
        if isinstance(o, list):
            return [dec(v) for v in o]
        if not isinstance(o, dict):
            return o
        tag = next((k for k in o if k.startswith(TAG)), None)
        if tag is None:
            return {k: dec(v) for k, v in o.items()}
        if tag == f"{TAG}tensor":
            if o[tag] not in tensors:
                raise StateCodecError(f"checkpoint refers to tensor {o[tag]!r}, which its tensor file lacks")
            return tensors[o[tag]]
        if tag == f"{TAG}float":
            return float(o[tag])
        if tag == f"{TAG}dtype":
            dtype = getattr(torch, o[tag], None)
            if not isinstance(dtype, torch.dtype):
                raise StateCodecError(f"checkpoint names an unknown dtype {o[tag]!r}")
            return dtype
        if tag == f"{TAG}tuple":
            return tuple(dec(v) for v in o[tag])
        if tag == f"{TAG}dict":
            return {dec(k): dec(v) for k, v in o[tag]}
        if tag == f"{TAG}enum":
            return cls(o[tag])(o["value"])
        if tag == f"{TAG}object":
            obj = object.__new__(cls(o[tag]))
            obj.__dict__.update(dec(o["fields"]))
            return obj
        raise StateCodecError(f"checkpoint holds an unknown tag {tag!r}")

    return dec(tree)
