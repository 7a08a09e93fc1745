"""Generator config (no torch import)."""

from __future__ import annotations

import os
import socket
from typing import Annotated, Literal, Union

from pydantic import Field

from broker.config import StrictModel


class SamplingConfig(StrictModel):
    """How completions are sampled. The behaviour log-probs are those of exactly this distribution."""

    n: int = Field(8, ge=1, le=256, description="completions per prompt (the group size)")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="softmax temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass (1.0 = off)")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0 = off)")
    max_tokens: int = Field(8, ge=1, le=32768, description="most new tokens per completion")


class TorchBackendConfig(StrictModel):
    """Plain PyTorch + transformers with a KV cache, batched: the CPU default for small models."""

    type: Literal["torch"] = "torch"
    threads: int = Field(1, ge=1, description="torch intra-op threads")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="weights dtype for sampling")


class SimulatedBackendConfig(StrictModel):
    """No model: valid random completions at a set speed (generators/simulated_backend.py), standing in
    for a GPU engine in benchmarks (``relay bench overlap``)."""

    type: Literal["simulated"] = "simulated"
    per_token_latency_s: float = Field(0.001, ge=0, le=10, description="seconds per generated token: every "
                                       "decode step sleeps this times the rows still running")
    load_s: float = Field(0.0, ge=0, le=600, description="extra seconds a load or weight update takes, after "
                          "reading the snapshot's files")
    eos_prob: float = Field(0.0, ge=0, le=1, description="chance that each token is EOS (0: every completion runs "
                            "to max_tokens)")


class GeneratorConfig(StrictModel):
    """One generator replica."""

    id: str = Field(default_factory=lambda: f"gen-{socket.gethostname()}-{os.getpid()}",
                    description="replica id, unique in the run (default: from the host name and PID)")
    run_id: str = Field("default", description="run id; namespaces every Redis key")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis server URL")
    broker_address: str = Field("tcp://127.0.0.1:5555", description="broker ingest address (ZeroMQ)")
    reward_url: str = Field("http://127.0.0.1:8090", description="reward service base URL")
    backend: Annotated[Union[TorchBackendConfig, SimulatedBackendConfig], Field(discriminator="type")] = Field(
        default_factory=TorchBackendConfig, description="inference backend, chosen by its type")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling parameters")
    prompts_per_batch: int = Field(8, ge=1, description="prompts claimed and generated together")
    claim_idle_s: float = Field(30.0, gt=0, description="reclaim prompts another generator held this long")
    reward_timeout_s: float = Field(30.0, gt=0, description="timeout of one reward-service call")
    reward_retries: int = Field(5, ge=0, description="retries of a failed reward call before marking items failed")
    reward_token: str = Field("", description="bearer token for the reward service (its auth_token); prefer "
                              "RELAY_REWARD_TOKEN to a file")
    seed: int = Field(0, description="sampling seed (combined with the replica id)")
    heartbeat_s: float = Field(1.0, gt=0, description="seconds between heartbeats")
    metrics_host: str = Field("127.0.0.1", description="bind address of the /metrics and /healthz server")
    metrics_port: int = Field(0, ge=0, le=65535, description="port of the /metrics and /healthz server; 0 picks a "
                              "free one (reported as metrics_port in the heartbeat)")
    exit_when_done: bool = Field(True, description="exit when the learner marks the run done")
