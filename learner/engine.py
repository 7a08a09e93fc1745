"""The model (built-in tiny or a Hugging Face folder) and the DeepSpeed training engine on CPU (gloo) or GPU (nccl)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from learner.config import LearnerConfig
from learner.model_folder import check_model_folder

log = logging.getLogger("relay.learner.engine")


def load_model(cfg: LearnerConfig, build: bool = True):
    """The model to train (fp32) and its tokenizer: the built-in tiny model, built into
    ``run_dir/base_model`` (unless ``build`` is false: another rank built it), or a Hugging Face folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(cfg.model)
    if cfg.model == "tiny":
        from learner.tiny_model import build_tiny_model

        path = Path(cfg.run_dir) / "base_model"
        if build:
            build_tiny_model(path, seed=cfg.seed, vllm_compatible=cfg.tiny.vllm_compatible, tools=cfg.tiny.tools)
    else:
        check_model_folder(cfg.model)  # the same check relay up makes before anything starts
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, tokenizer


# torch's JIT extensions (DeepSpeed's CPU communication op) take a lock file in their build folder on
# every load, build or not, and wait while it exists: a learner killed inside that window (a second or
# so, a build's half minute) left it behind, and every later learner waited forever. The CPU
# communication op is loaded under ``ops_lock``, which removes such a lock at once; this age limit is
# the fallback for any other op DeepSpeed loads.
STALE_LOCK_S = float(os.environ.get("RELAY_STALE_EXTENSION_LOCK_S", "180"))


def _extensions_root() -> str:
    from torch.utils.cpp_extension import get_default_build_root

    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


@contextlib.contextmanager
def stale_extension_locks_removed(root: str | Path | None = None, stale_s: float = STALE_LOCK_S, every_s: float = 1.0):
    """While the body runs (DeepSpeed loading its ops), remove any ``<op>/lock`` under the extensions
    folder (``TORCH_EXTENSIONS_DIR``, else torch's default) older than ``stale_s``: a build here takes
    well under a minute, so such a lock was left by a killed process. Logged, never silent."""
    if root is None:
        root = _extensions_root()
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(every_s):
            for lock in Path(root).glob("*/lock"):
                try:
                    age = time.time() - lock.stat().st_mtime
                    if age > stale_s:
                        lock.unlink()
                        log.warning(
                            "removed %s, left %.0f s ago by a process killed while loading or building "
                            "that op (RELAY_STALE_EXTENSION_LOCK_S=%g)",
                            lock,
                            age,
                            stale_s,
                        )
                except FileNotFoundError:
                    pass  # its owner finished meanwhile

    t = threading.Thread(target=watch, name="relay-extension-locks", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def init_distributed() -> tuple[int, int]:
    """The process group DeepSpeed trains in, joined; returns this process's (rank, world size). Several ranks (launched by relay up's rank launcher,
    deploy/launcher/ranks.py, torchrun or the deepspeed launcher): the ``env://`` rendezvous their launcher
    set up. One process of its own: a group of one over an in-memory store (``HashStore``): no store
    listens (before, a TCP store on a port picked free and bound later, which another run could take in
    between, listening on every interface); gloo's device, which listens for peers even when there are
    none, is kept on the loopback interface."""
    import deepspeed
    import torch.distributed as dist

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        _shm_comm_op_built()
    if os.environ["WORLD_SIZE"] == "1" and "MASTER_PORT" not in os.environ and not dist.is_initialized():
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and os.path.isdir("/sys/class/net/lo"):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's device listens even alone: on the loopback only
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)  # DeepSpeed adopts it
    elif os.environ.get("RELAY_LEARNER_NODES") == "1" and not dist.is_initialized():
        # a rank of a learner across nodes (deploy/launcher/nodes.py): the ranks' store on rank 0's node address
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=_nodes_store(rank, world), rank=rank, world_size=world)
    with stale_extension_locks_removed():
        deepspeed.init_distributed(dist_backend=backend)
    return dist.get_rank(), dist.get_world_size()


def _nodes_store(rank: int, world: int):
    """The ranks' store of a learner across nodes: rank 0 hosts it on a socket bound to its node's address
    (``MASTER_ADDR``, the agent's ``--local-addr``; torch's own would listen on every interface), the other
    ranks join it (retrying until it listens)."""
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(minutes=30)
    if rank != 0:
        return TCPStore(host, port, world, False, timeout)
    sock = socket.create_server((socket.gethostbyname(host), port), backlog=128)
    return TCPStore(host, port, world, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach())


def _shm_comm_op_built() -> None:
    """DeepSpeed's CPU communication op built and loaded before ``init_distributed`` loads it (DeepSpeed
    keeps it loaded), one Relay process at a time under ``ops_lock``."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    with ops_lock(builder.name):
        builder.load(verbose=False)


@contextlib.contextmanager
def ops_lock(op: str, root: str | Path | None = None):
    """Relay's own lock around loading ``op``: an ``flock`` on ``<extensions folder>/<op>.relay-lock``,
    which the kernel releases when its holder dies. torch's lock (``<op>/lock``, a plain file, taken on
    every load, built or not) outlives a process killed while holding it, and every later loader waits
    on it. Whoever holds the flock knows that no Relay process is loading ``op``, so a torch lock found
    then was left by a killed one: it is removed at once, logged, and the op is loaded (built again
    where the build was cut short). Without this, such a lock cost every later learner
    ``RELAY_STALE_EXTENSION_LOCK_S`` (a CI run's learners waited 3 minutes and one test timed out).
    A DeepSpeed process outside Relay that shares the folder and loads the op at that moment would
    lose its lock; Relay's folder is its own (``.cache/torch_extensions``)."""
    import fcntl

    if root is None:
        root = _extensions_root()
    Path(root).mkdir(parents=True, exist_ok=True)
    with open(Path(root) / f"{op}.relay-lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            left = Path(root) / op / "lock"
            if left.exists():
                left.unlink()
                log.warning("removed %s, left by a process killed while it loaded or built that op", left)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def close_distributed() -> None:
    """End the process group in step on every rank: a barrier, so no rank leaves while another still
    talks to it, then ``destroy_process_group``. A rank that exits with the group alive can abort in
    the backend's destructors ("terminate called without an active exception", SIGABRT), and torchrun
    then kills its peers and reports the run failed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def build_engine(
    model: torch.nn.Module, cfg: LearnerConfig, optimizer: torch.optim.Optimizer | None = None, critic: bool = False
):
    """Wrap ``model`` in a DeepSpeed engine with a torch AdamW (avoids compiling DeepSpeed's fused Adam),
    or ``optimizer``; with ``critic``, the critic's (its learning rate and DeepSpeed settings,
    ``learner.critic``; learner/critic.py enables its activation checkpointing). Gradient
    accumulation is the caller's: every ``backward`` accumulates, every ``step`` reduces over ranks
    and updates (``managed_gradient_accumulation: false``), so a (mini)batch can have any number of
    micro-batches (learner/update.py)."""
    import deepspeed

    init_distributed()
    if cfg.compute.gradient_checkpointing and not critic:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ds, lr = (cfg.critic.deepspeed, cfg.critic.lr) if critic else (cfg.deepspeed, cfg.optim.lr)
    if optimizer is None:
        # the trained parameters only: with LoRA (learner/lora.py) the frozen base has no optimizer state
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=cfg.optim.weight_decay
        )
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": ds.gradient_clipping,
        "bf16": {"enabled": ds.bf16},
        "zero_optimization": {
            "stage": ds.zero_stage,
            "stage3_param_persistence_threshold": ds.zero3_persistence_threshold,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,  # a torch optimizer (AdamW, or the tests' SGD) under ZeRO
    }
    with stale_extension_locks_removed():
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if engine.world_size == 1 and ds.zero_stage == 0:
        engine.enable_backward_allreduce = False  # nothing to average over: skip flattening every gradient
    return engine


def full_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The full weights for publication, on rank 0 (None on the other ranks). Every rank must call
    it: at ZeRO stage 3 each rank holds a partition of every large weight, and the weights are
    gathered layer by layer, a collective."""
    if engine.zero_optimization_stage() == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return engine.module.state_dict() if engine.global_rank == 0 else None
