"""Learner checkpoints without pickle: safetensors for the weights and the optimizer's tensors, JSON
for everything else (step, version, counters, the optimizer's hyper-parameters, and the stream
entries trained since the previous checkpoint, which the checkpoint now holds).

Layout: ``<dir>/step-000050/{model.safetensors, optimizer.safetensors, state.json}`` and
``<dir>/latest`` (the name of the newest complete checkpoint). A checkpoint is written under a
temporary name, fsynced and renamed; ``latest`` is replaced atomically afterwards, so a learner
killed at any moment finds the previous complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model


class CheckpointError(RuntimeError):
    pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
         keep: int = 2) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))  # handles tied weights (embeddings = lm_head)
    opt = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, st in opt["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().contiguous().cpu()
            else:
                scalars[f"{idx}.{k}"] = v
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    meta = {"step": step, "param_groups": opt["param_groups"], "optimizer_scalars": scalars, **state}
    with open(tmp / "state.json", "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    latest_tmp = root / f".latest-{os.getpid()}"
    latest_tmp.write_text(name)
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(root: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """Restore the newest checkpoint into ``model`` and ``optimizer``; return its state (None if none)."""
    root = Path(root)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is incomplete")
    meta = json.loads((path / "state.json").read_text())
    missing, unexpected = load_model(model, str(path / "model.safetensors"))
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    tensors = load_file(str(path / "optimizer.safetensors"))
    state: dict = {}
    for key, v in list(tensors.items()) + list(meta.pop("optimizer_scalars").items()):
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    optimizer.load_state_dict({"state": state, "param_groups": meta.pop("param_groups")})
    return meta
