"""Run records a user can analyse: every step's scalars as TensorBoard event files in the run folder
(``<run_dir>/tensorboard/``, next to ``metrics.jsonl``), and optionally to Weights & Biases.

TensorBoard files are written with the ``tensorboard`` package's own event writer (a dependency of
Relay; no torch needed, so ``relay up`` writes the evaluation rounds with it too). W&B is off by
default and never required: ``wandb`` is imported only when ``learner.metrics.wandb.enabled`` is true, and a
missing package is then a clear start-up error.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pydantic import Field

from broker.runtime.config import StrictModel

log = logging.getLogger("relay.learner.records")


class WandbConfig(StrictModel):
    """Weights & Biases logging (off by default; needs `pip install wandb` and a login or WANDB_API_KEY)."""

    enabled: bool = Field(False, description="log every step's scalars to W&B")
    project: str = Field("relay", description="W&B project")
    entity: str = Field("", description="W&B entity (team or user); empty = your default")
    mode: str = Field("online", description="online, offline (sync later with `wandb sync`) or disabled")


def scalars(diag: dict, prefix: str = "") -> dict[str, float]:
    """The numeric entries of a metrics dict (nested dicts flattened with '/'; lists left out)."""
    out: dict[str, float] = {}
    for k, v in diag.items():
        if isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
        elif isinstance(v, (int, float)):
            out[f"{prefix}{k}"] = float(v)
        elif isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
    return out


class TensorBoardWriter:
    """Scalars into a TensorBoard event file (one file per writer, in ``logdir``)."""

    def __init__(self, logdir: str | Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(logdir))

    def add_scalars(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        self.writer.add_event(Event(wall_time=wall_time or time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class RunRecords:
    """The learner's per-step records beyond ``metrics.jsonl``: TensorBoard and, when enabled, W&B."""

    def __init__(self, run_dir: str | Path, tensorboard: bool, wandb_cfg: WandbConfig, run_id: str, config: dict):
        self.tb = TensorBoardWriter(Path(run_dir) / "tensorboard") if tensorboard else None
        self.wandb = None
        if wandb_cfg.enabled:
            try:
                import wandb
            except ImportError:
                raise RuntimeError(
                    "learner.metrics.wandb.enabled is true but the wandb package is not installed "
                    "(pip install wandb), or set learner.metrics.wandb.enabled = false"
                ) from None
            self.wandb = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity or None,
                name=run_id,
                mode=wandb_cfg.mode,
                config=config,
            )

    def log(self, diag: dict) -> None:
        values = scalars(diag)
        step = int(diag.get("step", 0))
        if self.tb is not None:
            self.tb.add_scalars(step, values, diag.get("t"))
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


EVAL_SCALARS = ("pass@1", "pass@k", "mean_reward", "mean_length", "n_prompts")


def write_eval(logdir: str | Path, rounds: list[dict]) -> None:
    """The evaluation rounds as TensorBoard scalars ``eval/<name>`` at step = the round's version."""
    if not rounds:
        return
    w = TensorBoardWriter(logdir)
    for rnd in rounds:
        w.add_scalars(
            rnd["version"], {f"eval/{k}": rnd[k] for k in EVAL_SCALARS if isinstance(rnd.get(k), (int, float))}
        )
    w.close()
