"""Generator backends behind one interface (base.py), chosen by ``backend.type``."""

from __future__ import annotations

from generators.backends.base import Backend


def make_backend(cfg) -> Backend:
    """The backend ``cfg.type`` names (its heavy imports happen here, not at start-up)."""
    if cfg.type == "torch":
        from generators.backends.torch import TorchBackend

        return TorchBackend(cfg)
    if cfg.type == "vllm":
        from generators.backends.vllm import VLLMBackend

        return VLLMBackend(cfg)
    if cfg.type == "sglang":
        from generators.backends.sglang import SGLangBackend

        return SGLangBackend(cfg)
    if cfg.type == "simulated":
        from generators.backends.simulated import SimulatedBackend

        return SimulatedBackend(cfg)
    raise ValueError(f"unknown generator backend {cfg.type!r}")
