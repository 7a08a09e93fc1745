"""Learner checkpoints for every ZeRO stage, in bf16 and fp32, on one or several ranks, without pickle.

Layout of ``<dir>/step-000050/``:

- ``state.json`` (the leader): the step and what the learner keeps beside the engine (version,
  counters, the stream entries trained since the previous checkpoint), and the engine settings the
  checkpoint was written with (ranks, ZeRO stage, bf16), checked when it is loaded;
- ``model.safetensors`` (the leader, ZeRO stages 0-2, where every rank holds the whole model): the
  weights as trained (bf16 in bf16 runs); with LoRA only the adapters (the frozen base is loaded again
  from the model folder; ``state.json`` says ``adapters_only``);
- ``rank-00000.json`` + ``rank-00000.safetensors``, one pair per rank (only rank 0's at stage 0, where
  every rank's optimizer is the same): that rank's optimizer ``state_dict`` as DeepSpeed returns it
  (stages 1-3: its partition of the fp32 master weights, AdamW's ``exp_avg``/``exp_avg_sq`` and step,
  the loss scaler; stage 0: torch's AdamW state, or DeepSpeed's bf16 wrapper around it), flattened by
  ``learner.state_codec``, plus the engine's step counters and the rank's torch RNG state.
- ``critic/`` (with ``learner.critic``): the critic's engine in the same layout (``model.safetensors``,
  the ranks' parts); ``state.json``'s ``critic`` holds its engine settings (null without a critic).

Every rank calls ``save`` (ZeRO-3 gathers its persistent parameters afterwards, a collective). The
leader makes ``.tmp-step-000050``, every rank writes and fsyncs its part there, a barrier waits
for all parts, and only then does the leader rename the folder and replace ``latest`` atomically,
so a learner killed at any moment finds the previous complete checkpoint. ``load`` is the mirror
of DeepSpeed's own ``load_checkpoint`` with the pickle files replaced: module weights, then the
optimizer's ``load_state_dict`` with this rank's part (fp32 master weights restored from the part,
not from the bf16 copy), so a resumed run continues bit for bit as if it had not stopped.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from learner import state_codec

FORMAT = 2  # state.json's "format": 1 was the ZeRO-0 fp32 layout (model + optimizer.safetensors)


class CheckpointError(RuntimeError):
    pass


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())


def _engine_settings(engine, world: int) -> dict:
    # adapters_only: LoRA (learner/lora.py), whose checkpoints hold the adapters and not the frozen base
    return {
        "ranks": world,
        "zero_stage": int(engine.zero_optimization_stage()),
        "bf16": bool(engine.bfloat16_enabled()),
        **({"adapters_only": True} if _frozen(engine.module) else {}),
    }


def _module_weights(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's weights once each, and the names tied to another (``lm_head.weight`` to the
    embeddings). ZeRO 1-2 keep every weight in one flat buffer, so each is stored as a copy."""
    kept: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in module.state_dict().items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
            kept[name] = t
    return kept, tied


def _frozen(module: torch.nn.Module) -> set[str]:
    """The names of the module's frozen parameters (LoRA's base, learner/lora.py): never trained, loaded
    again from the model folder on resume, so not checkpointed."""
    return {n for n, p in module.named_parameters() if not p.requires_grad}


def _save_module(module: torch.nn.Module, path: Path) -> None:
    kept, _ = _module_weights(module)
    frozen = _frozen(module)
    save_file({k: v.detach().to("cpu").clone() for k, v in kept.items() if k not in frozen}, str(path))
    _fsync_file(path)


def _load_module(module: torch.nn.Module, path: Path) -> None:
    weights = load_file(str(path))
    tied = _module_weights(module)[1]
    for name, same in tied.items():
        if same in weights:
            weights[name] = weights[same]
    missing, unexpected = module.load_state_dict(weights, strict=False)
    frozen = _frozen(module)
    frozen |= {name for name, same in tied.items() if same in frozen}  # a tied head of a frozen embedding
    missing = [k for k in missing if k not in frozen]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the model (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )


def _rank_part(engine) -> dict:
    """What this rank alone holds: its optimizer state (partition), the engine's counters, its RNG."""
    part = {
        "optimizer": engine.optimizer.state_dict(),
        "engine": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
        },
        "rng": {"cpu": torch.get_rng_state()},
    }
    if torch.cuda.is_available():
        part["rng"]["cuda"] = torch.cuda.get_rng_state()
    return part


def _save_part(folder: Path, rank: int, part: dict) -> None:
    try:
        tree, tensors = state_codec.encode(part)
    except state_codec.StateCodecError as e:
        raise CheckpointError(str(e)) from e
    save_file(tensors, str(folder / f"rank-{rank:05d}.safetensors"))
    _fsync_file(folder / f"rank-{rank:05d}.safetensors")
    _write_json(folder / f"rank-{rank:05d}.json", tree)


def _load_part(folder: Path, rank: int) -> dict:
    tree_path, tensor_path = folder / f"rank-{rank:05d}.json", folder / f"rank-{rank:05d}.safetensors"
    if not tree_path.is_file() or not tensor_path.is_file():
        raise CheckpointError(f"{folder} lacks rank {rank}'s part ({tree_path.name}, {tensor_path.name})")
    try:
        return state_codec.decode(json.loads(tree_path.read_text()), load_file(str(tensor_path)))
    except state_codec.StateCodecError as e:
        raise CheckpointError(f"{tree_path}: {e}") from e


def _save_engine(folder: Path, engine, rank: int) -> None:
    """This rank's part of ``engine`` in ``folder`` (the module's weights too, on the leader below ZeRO-3)."""
    zero = engine.zero_optimization_stage()
    if hasattr(engine.optimizer, "checkpoint_event_prologue"):
        engine.optimizer.checkpoint_event_prologue()  # ZeRO-3: every parameter back to its partition
    if rank == 0 or zero > 0:
        _save_part(folder, rank, _rank_part(engine))
    if hasattr(engine.optimizer, "checkpoint_event_epilogue"):
        engine.optimizer.checkpoint_event_epilogue()  # ZeRO-3: persistent parameters gathered again
    if rank == 0 and zero < 3:
        _save_module(engine.module, folder / "model.safetensors")


def save(root: str | Path, step: int, engine, state: dict, keep: int = 2, critic=None) -> Path:
    """Write checkpoint ``step`` of ``engine`` (and of the ``critic``'s engine, in ``critic/`` with the
    same layout) with the leader's ``state`` (JSON values); every rank must call it. Returns the
    checkpoint's folder once ``latest`` names it."""
    rank, world = _rank_world()
    root = Path(root)
    name = f"step-{step:06d}"
    tmp, final = root / f".tmp-{name}", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a learner killed while writing
            shutil.rmtree(stale)
        tmp.mkdir()
        if critic is not None:
            (tmp / "critic").mkdir()
    _barrier()
    _save_engine(tmp, engine, rank)
    if critic is not None:
        _save_engine(tmp / "critic", critic, rank)
    if rank == 0:
        crit = _engine_settings(critic, world) if critic is not None else None
        _write_json(
            tmp / "state.json",
            {"format": FORMAT, "step": step, **_engine_settings(engine, world), "critic": crit, **state},
        )
        if critic is not None:
            _fsync_dir(tmp / "critic")
    _barrier()  # every rank's part is on disk
    if rank == 0:
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        latest_tmp = root / ".latest.tmp"
        latest_tmp.write_text(name)
        os.replace(latest_tmp, root / "latest")
        _fsync_dir(root)
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def load(root: str | Path, engine, critic=None) -> dict | None:
    """Restore the newest checkpoint into ``engine`` (weights, optimizer, counters, RNG) and ``critic``
    on this rank; return the leader's state (None if there is no checkpoint). Every rank must call it."""
    rank, world = _rank_world()
    root = Path(root)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is incomplete")
    meta = json.loads((path / "state.json").read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} was written by an older Relay (format {meta.get('format', 1)}, this one reads "
            f"{FORMAT}); start the run in a new run_dir"
        )
    saved_critic = meta.pop("critic", None)
    if (saved_critic is None) != (critic is None):
        raise CheckpointError(
            f"{path} was written {'with' if saved_critic else 'without'} a critic, this learner "
            f"runs {'with' if critic is not None else 'without'} one (learner.critic.enabled): "
            "resume with the setting that wrote it, or start the run in a new run_dir"
        )
    _load_engine(
        path,
        engine,
        {k: meta.pop(k) for k in ("ranks", "zero_stage", "bf16", "adapters_only") if k in meta},
        rank,
        world,
    )
    if critic is not None:
        _load_engine(path / "critic", critic, saved_critic, rank, world)
    return meta


def _load_engine(path: Path, engine, saved: dict, rank: int, world: int) -> None:
    """``engine``'s weights, this rank's optimizer part, counters and RNG from checkpoint folder ``path``,
    written with the engine ``saved`` settings."""
    settings = _engine_settings(engine, world)
    if settings["zero_stage"] == 0 and saved["zero_stage"] == 0:
        saved["ranks"] = settings["ranks"]  # the same state on every rank: any number of ranks may load it
    if saved != settings:
        raise CheckpointError(
            f"{path} was written with {saved}, this learner runs {settings}; ZeRO partitions "
            "are per rank and per precision: resume with the settings that wrote it, or start "
            "the run in a new run_dir"
        )
    zero = settings["zero_stage"]
    part = _load_part(path, rank if zero > 0 else 0)
    if hasattr(engine.optimizer, "checkpoint_event_prologue"):
        engine.optimizer.checkpoint_event_prologue()
    if zero < 3:
        _load_module(engine.module, path / "model.safetensors")
    if zero > 0:  # as DeepSpeed's _load_zero_checkpoint: one entry per rank, each rank reads its own
        parts = [None] * world
        parts[rank] = part["optimizer"]
        engine.optimizer.load_state_dict(state_dict_list=parts, load_optimizer_states=True, load_from_fp32_weights=True)
    elif engine.bfloat16_enabled() or engine.fp16_enabled():  # DeepSpeed's wrapper: its fp32 master weights too
        engine.optimizer.load_state_dict(part["optimizer"], load_optimizer_states=True)
    else:  # torch's AdamW itself
        engine.optimizer.load_state_dict(part["optimizer"])
    if hasattr(engine.optimizer, "checkpoint_event_epilogue"):
        engine.optimizer.checkpoint_event_epilogue()
    for k, v in part["engine"].items():
        setattr(engine, k, v)
    torch.set_rng_state(part["rng"]["cpu"])
    if "cuda" in part["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(part["rng"]["cuda"])
