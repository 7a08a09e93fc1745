"""Learner config (no torch import)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from broker.protocol.keys import RECORD_WINDOW
from broker.runtime.binds import ALLOW_DESCRIPTION, refuse_open_bind
from broker.protocol.weights_config import WeightsConfig
from broker.runtime.config import RunConnection, StrictModel
from learner.records import WandbConfig

# The valid option names, defined once: losses.py, correction.py and advantages.py derive theirs from these.
CorrectionMode = Literal["none", "tis", "mis", "token_mis", "icepop", "seq_tis", "seq_mis", "geo_mis", "decoupled"]
PolicyLoss = Literal["ppo", "cispo", "reinforce"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3", "abs"]
AdvantageEstimator = Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "vtrace"]
NEEDS_CRITIC = ("gae", "vtrace")  # per-token estimators over the critic's values (learner/critic.py)

# the built-in tiny model learns the copy task at this rate; at 2e-3 (the default until 6 December 2026) 5 of 18 runs
# of the default task collapsed onto a wrong digit on the way, whatever the learner's layout (docs/learner.md)
TINY_LR = 1e-3
# ... and with gae / vtrace, whose whitened per-token advantages keep unit scale (docs/learner.md)
TINY_LR_PER_TOKEN = 5e-4
PRETRAINED_LR = 1e-6  # a pretrained LM: the usual RL fine-tuning rate (verl's and OpenRLHF's GRPO examples)
LORA_LR_SCALE = 10.0  # LoRA adapters train at about 10x the full fine-tuning rate (the usual LoRA practice)


# learning rates a model trains at lie within these factors of its kind's default rate (tiny or pretrained, with
# or without LoRA; _default_lr): below, hardly anything moves; above, training usually diverges (docs/learner.md)
LR_BELOW, LR_ABOVE = 100.0, 20.0


def lr_problems(cfg: "LearnerConfig") -> tuple[str | None, list[str]]:
    """The learning rates' check: (an error, warnings). An error for a rate no model trains at: 1 or more
    (AdamW moves every weight by about the rate at each step; weights are ~0.02); a warning for one far from
    the rate the model's kind trains at (outside LR_BELOW / LR_ABOVE times it)."""
    kind = "the built-in tiny model" if cfg.model == "tiny" else "a pretrained model"
    usual = (
        (TINY_LR_PER_TOKEN if cfg.advantages.estimator in NEEDS_CRITIC else TINY_LR)
        if cfg.model == "tiny"
        else PRETRAINED_LR
    )
    warnings = []
    critic = cfg.critic.lr if cfg.critic.enabled else None
    for name, lr, scale, what in (
        (
            "learner.optim.lr",
            cfg.optim.lr,
            LORA_LR_SCALE if cfg.lora.rank else 1.0,
            " with LoRA" if cfg.lora.rank else "",
        ),
        ("learner.critic.lr", critic, 1.0, "'s critic"),
    ):
        if lr is None:
            continue
        if lr >= 1:
            return (
                f"{name} = {lr:g} is no learning rate: AdamW would move every weight by about {lr:g} at each step "
                f"(the weights are ~0.02); models train at {PRETRAINED_LR:g} (pretrained) to {TINY_LR:g} (the "
                f"tiny model): set {name} below 1, or leave it unset for the model's default (docs/learner.md)"
            ), []
        rate = usual * scale
        lo, hi = rate / LR_BELOW, rate * LR_ABOVE
        if not lo <= lr <= hi:
            how = f"{lr / rate:.0f}x above" if lr > hi else f"{rate / lr:.0f}x below"
            fate = "training usually diverges (the policy dies)" if lr > hi else "hardly anything will be learnt"
            warnings.append(
                f"{name} = {lr:g} is {how} the {rate:g} that {kind}{what} trains at: {fate}; a rate "
                f"from {lo:g} to {hi:g} suits it (docs/learner.md)"
            )
    return None, warnings


class CorrectionConfig(StrictModel):
    """Off-policy correction against the behaviour log-probs μ (see docs/off-policy.md)."""

    mode: CorrectionMode = Field(
        "tis",
        description="none: plain PPO-clip; tis: truncated IS per token; mis: mask tokens whose π_old/μ "
        "is above mask_hi; token_mis: mask tokens whose π_old/μ is outside [mask_lo, mask_hi]; icepop: weight "
        "π_old/μ inside [mask_lo, mask_hi], 0 outside, nothing masked; seq_tis/seq_mis/geo_mis: sequence-level "
        "weights or masks; decoupled: AReaL's π_prox/μ weight",
    )
    tis_cap: float | None = Field(
        2.0, gt=0, description="truncation C of the weight (tis, seq_tis, decoupled); null = none"
    )
    mask_lo: float = Field(
        0.5, ge=0, description="lower bound of the kept ratio interval (token_mis, icepop, seq_mis, geo_mis)"
    )
    mask_hi: float = Field(5.0, gt=0, description="upper bound of the kept ratio interval (masking modes)")


class DeepSpeedConfig(StrictModel):
    """The DeepSpeed engine."""

    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO stage 0-3")
    bf16: bool = Field(False, description="train in bf16 (fp32 master weights)")
    gradient_clipping: float = Field(1.0, ge=0, description="global gradient-norm clip (0 = off)")
    zero3_persistence_threshold: int = Field(
        100_000,
        ge=0,
        description="ZeRO stage 3: parameters with fewer elements than this stay whole on every "
        "rank instead of being partitioned (DeepSpeed's stage3_param_persistence_threshold); 0 partitions all",
    )


class CriticConfig(StrictModel):
    """The value model (learner/critic.py): a separate model, the policy's trunk with a scalar head, trained by
    its own DeepSpeed engine with verl's clipped value loss (docs/learner.md)."""

    enabled: bool = Field(False, description="train a critic; gae and vtrace need it")
    model: str | None = Field(
        None,
        description="the critic's trunk: null = a copy of the policy's initial weights; "
        "or a local Hugging Face folder (a causal LM: its trunk is used, its LM head dropped)",
    )
    lr: float | None = Field(None, gt=0, description="the critic's AdamW learning rate; null = the policy's")
    cliprange_value: float = Field(
        0.5,
        gt=0,
        description="verl's cliprange_value: the new value is clipped to the old one ± this in the clipped value loss",
    )
    deepspeed: DeepSpeedConfig | None = Field(
        None,
        description="the critic's DeepSpeed engine (ZeRO stage, bf16, "
        "gradient clipping); null = the same settings as learner.deepspeed",
    )


class LoraConfig(StrictModel):
    """``learner.lora``: train low-rank adapters through peft instead of every weight (docs/learner.md, "LoRA")."""

    rank: int = Field(0, ge=0, le=1024, description="LoRA rank r; 0 = off (every weight is trained)")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the adapter's update is scaled by alpha / rank")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout on the adapter's input while training (0 keeps "
        "the learner's log-probs deterministic, as the off-policy ratio assumes)",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="the modules that get adapters: 'all-linear' (every linear layer but the output "
        "head) or a list of module names (q_proj, v_proj, ...)",
    )
    publish: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="what each version holds: 'adapter' (the adapter alone, a few MB, the base model "
        "sent once), 'merged' (the whole model with the adapters merged in); 'auto': adapter, except merged with "
        "weights.transport = collective (which broadcasts whole models)",
    )


class PolicyLossConfig(StrictModel):
    """The policy loss (learner/losses.py): its fields sit directly under ``learner`` (LearnerConfig extends it)."""

    policy_loss: PolicyLoss = Field("ppo", description="policy loss")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip ε (the lower bound 1-ε)")
    clip_eps_high: float | None = Field(
        None, gt=0, description="upper clip ε (asymmetric, 'clip-higher'); null = clip_eps"
    )
    dual_clip: float | None = Field(None, gt=1, description="dual-clip bound c for negative advantages; null = off")
    aggregation: Aggregation = Field("token-mean", description="how per-token losses are reduced to one number")
    loss_scale_tokens: int = Field(
        0,
        ge=0,
        description="T of seq-mean-token-sum-norm: each sequence's Σ_t ℓ is divided by this constant "
        "(Dr.GRPO, verl's loss_scale_factor), the same whatever the prompts, the padding or the micro-batches; "
        "0 = the generation budget, learner.batch.max_completion_tokens (relay up sets it from the generators' "
        "sampling.max_tokens)",
    )
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig, description="off-policy correction")


# the learner's keys that moved into sections (issue 41): old -> new; the old ones keep working, with a warning
# (broker/runtime/config.py move_renamed; docs/config.md, "Renamed keys")
RENAMED = {
    "tiny_vllm_compatible": "tiny.vllm_compatible",
    "tiny_tools": "tiny.tools",
    "target_reward": "target.reward",
    "target_window": "target.window",
    "lr": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "minibatches": "optim.minibatches",
    "ppo_epochs": "optim.ppo_epochs",
    "batch_groups": "batch.groups",
    "max_staleness": "batch.max_staleness",
    "admission_eta": "batch.admission_eta",
    "failed_reward": "batch.failed_reward",
    "fallback_score": "batch.fallback_score",
    "wait_timeout_s": "batch.wait_timeout_s",
    "record_window": "batch.record_window",
    "threads": "compute.threads",
    "micro_batch_tokens": "compute.micro_batch_tokens",
    "logprob_chunk_tokens": "compute.logprob_chunk_tokens",
    "gradient_checkpointing": "compute.gradient_checkpointing",
    "sequence_parallel": "compute.sequence_parallel",
    "kl_coef": "regularization.kl_coef",
    "kl_in_reward": "regularization.kl_in_reward",
    "kl_estimator": "regularization.kl_estimator",
    "entropy_coef": "regularization.entropy_coef",
    "advantage": "advantages.estimator",
    "gamma": "advantages.gamma",
    "lam": "advantages.lam",
    "rho_bar": "advantages.rho_bar",
    "c_bar": "advantages.c_bar",
    "publish_every": "publish.every",
    "keep_versions": "publish.keep_versions",
    # "versions_kept" read as the store's versions, next to keep_versions: it counts announcements in Redis
    "versions_kept": "publish.keep_announcements",
    "checkpoint_every": "publish.checkpoint_every",
    "metrics_host": "metrics.host",
    "metrics_port": "metrics.port",
    "metrics_history": "metrics.history",
    "tensorboard": "metrics.tensorboard",
    "wandb": "metrics.wandb",
    "rank_checksums": "metrics.rank_checksums",
}


class TinyConfig(StrictModel):
    """``learner.tiny``: how the built-in tiny model (``model = "tiny"``) is built."""

    vllm_compatible: bool = Field(
        False,
        description="build it as a Llama with attention heads "
        "of 32, which vLLM's CPU attention supports (relay up --backend vllm sets it)",
    )
    tools: bool = Field(
        False,
        description="append the tool symbols (* <tool_call> "
        "</tool_call> <tool_response> </tool_response>) to its vocabulary, for tasks whose "
        "environment calls tools (relay up --task calc sets it)",
    )


class TargetConfig(StrictModel):
    """``learner.target``: ending a run early once it trains well enough (learner/target.py)."""

    reward: float | None = Field(
        None,
        description="end the run early, completed, once the mean reward of "
        "the last target.window trained groups reaches this (a checkpoint, the last "
        "version published, summary.json's ended says so); null = train every step",
    )
    window: int = Field(
        256, ge=1, description="groups in target.reward's moving mean (the first target.window groups never end a run)"
    )


class OptimConfig(StrictModel):
    """``learner.optim``: the optimizer (AdamW) and how each batch becomes its steps."""

    lr: float | None = Field(
        None,
        gt=0,
        description="AdamW learning rate; null = the default for the model: "
        f"{TINY_LR} for 'tiny' ({TINY_LR_PER_TOKEN} with gae or vtrace), {PRETRAINED_LR} for a "
        "model given by path (docs/learner.md)",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    minibatches: int = Field(1, ge=1, description="optimizer steps per batch (the batch split into this many parts)")
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch")


class BatchConfig(StrictModel):
    """``learner.batch``: which groups make a batch: how many, how old, admitted how, with failed rewards how."""

    groups: int = Field(32, ge=1, description="groups per optimizer step")
    max_staleness: int = Field(4, ge=0, description="drop (and count) groups more than this many versions old")
    admission_eta: int | None = Field(
        0,
        ge=0,
        description="η: generators admit prompts only while admitted < "
        "(η + learner version + 1) × batch.groups; null disables admission control",
    )
    failed_reward: Literal["skip", "fallback"] = Field(
        "skip",
        description="samples whose reward failed: skip (leave them out; a group with none left is dropped "
        "and counted) or fallback (train on them with fallback_score as their reward)",
    )
    fallback_score: float = Field(
        0.0, ge=-1e6, le=1e6, description="the reward of a failed sample when failed_reward = 'fallback'"
    )
    wait_timeout_s: float = Field(600.0, gt=0, description="give up when no group arrives for this long")
    max_completion_tokens: int = Field(
        0,
        ge=0,
        description="the generation budget: most tokens of a sample after its prompt (relay up sets it from "
        "generator.sampling.max_tokens, or generator.episodes.max_tokens with an environment); 0 = not known",
    )
    max_prompt_tokens: int = Field(
        0,
        ge=0,
        description="most tokens of a prompt (relay up sets it from broker.dataset.max_prompt_tokens, or the "
        "built-in task's longest prompt); 0 = not known",
    )
    record_window: int = Field(
        RECORD_WINDOW,
        ge=0,
        description="group ids remembered as committed (exactly-once "
        "commits after a restart) and entries kept in the commit and drop logs: the last "
        "record_window to 2x as many; 0 keeps the whole run's (Redis memory grows with it)",
    )


class ComputeConfig(StrictModel):
    """``learner.compute``: how a step is computed within the learner's memory and cores."""

    threads: int = Field(1, ge=1, description="torch intra-op threads")
    micro_batch_tokens: int = Field(
        8192,
        ge=16,
        description="token budget of one forward/backward: samples of "
        "similar length, (samples × the longest one's prompt + completion tokens) at most "
        "this; the gradients of a (mini)batch's micro-batches accumulate into one "
        "optimizer step. Bounds the learner's memory, whatever the batch size; the learner refuses to start "
        "when batch.max_prompt_tokens + batch.max_completion_tokens (the longest sequence; both known) exceeds it",
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=1,
        description="positions whose full-vocabulary logits exist at once "
        "when computing log-probs and entropy (recomputed in the backward)",
    )
    shared_prompt: bool = Field(
        True,
        description="compute each group's prompt once for its samples (one forward "
        "fills a KV cache that the group's completions continue from): the same log-probs "
        "and gradients as every sample whole, with P + n·C tokens of work instead of n·(P + C). "
        "Off with gradient_checkpointing, a critic or packing, and where the model fails the start-up check",
    )
    packing: bool = Field(
        False,
        description="pack each micro-batch's samples into one row without padding (position ids restarting "
        "at each sample, attention never across one: a model on SDPA gets one SDPA call per sample, "
        "learner/packing.py relay_packed; flash-attention's variable-length path where the model uses it): "
        "the same log-probs and gradients with no padding computed, up to "
        "micro_batch_tokens tokens per micro-batch. Takes precedence over shared_prompt; a model whose "
        "attention ignores the restarting positions is refused at start-up (docs/learner.md)",
    )
    old_logprobs_from_loss: bool = Field(
        True,
        description="with one optimizer step per batch (optim.ppo_epochs = optim.minibatches = 1), take π_old "
        "from each loss micro-batch's own forward, detached (the weights before the update), instead of a "
        "forward of its own over the whole batch first: about a third of a step's compute. Where π_old of "
        "the whole batch is needed before the loss (a seq-mean aggregation with a rejecting correction or "
        "top-k/top-p sampling, kl_in_reward, vtrace) the forward runs anyway (learner/update.py old_logprobs_up_front)",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="activation checkpointing: recompute each layer's "
        "activations in the backward instead of keeping them (less memory, "
        "about a third more compute)",
    )
    sequence_parallel: int = Field(
        1,
        ge=1,
        le=64,
        description="Ulysses sequence parallelism: each micro-batch's packed row split over this many learner "
        "ranks, attention computed with an all-to-all over heads (learner/sequence_parallel.py); "
        "micro_batch_tokens then bounds each rank's share, so a micro-batch holds up to k × micro_batch_tokens "
        "tokens. The learner's ranks are data-parallel groups of k (relay up --learner-ranks a multiple of k); "
        "rows are packed whatever compute.packing says. 1 = off. Not with a critic; a model whose attention "
        "cannot be split (key-value heads fewer than k, sliding windows) is refused at start-up (docs/learner.md)",
    )


class RegularizationConfig(StrictModel):
    """``learner.regularization``: the terms besides the policy loss: a KL to the initial weights, an entropy bonus."""

    kl_coef: float = Field(
        0.0,
        ge=0,
        description="weight of a KL(π_θ || π_ref) loss term to a frozen reference "
        "model (the initial weights); 0 = no reference model",
    )
    kl_in_reward: bool = Field(
        False,
        description="put the KL term in the reward instead of the loss (verl's "
        "use_kl_in_reward with a fixed coefficient): each sample's reward minus kl_coef × "
        "Σ_t kl_estimator(log π_old, log π_ref), before the advantage estimator; needs "
        "kl_coef > 0",
    )
    kl_estimator: KLEstimator = Field(
        "k3",
        description="per-token KL estimator of that term: k1 = log π − log π_ref, "
        "k2 = ½(log π − log π_ref)², k3 = verl's low_var_kl (clamped to ±10), "
        "abs = |log π − log π_ref|",
    )
    entropy_coef: float = Field(0.0, ge=0, description="weight of an entropy bonus (of the sampling distribution)")

    @model_validator(mode="after")
    def _kl_in_reward_needs_a_coefficient(self) -> RegularizationConfig:
        if self.kl_in_reward and self.kl_coef <= 0:
            raise ValueError("kl_in_reward needs kl_coef > 0 (the weight of the KL in the reward)")
        return self


class AdvantagesConfig(StrictModel):
    """``learner.advantages``: the advantage estimator and its parameters (learner/advantages.py)."""

    estimator: AdvantageEstimator = Field(
        "grpo",
        description="advantage estimator: grpo, drgrpo, rloo (over each "
        "group); reinforce_pp, reinforce_pp_baseline (whitened over the batch); gae, "
        "vtrace (per token, over the critic's values; need critic.enabled)",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="discount γ of gae and vtrace")
    lam: float = Field(1.0, ge=0, le=1, description="GAE λ")
    rho_bar: float = Field(
        1.0, gt=0, description="vtrace: truncation ρ̄ of the importance ratio π_old/μ in the temporal differences"
    )
    c_bar: float = Field(1.0, gt=0, description="vtrace: truncation c̄ of the ratio in the traces")


class PublishConfig(StrictModel):
    """``learner.publish``: what the learner writes out, how often, and how much of it it keeps."""

    every: int = Field(1, ge=1, description="publish a new version every k steps")
    keep_versions: int = Field(4, ge=1, description="newest versions kept in the weight store (plus those served)")
    keep_announcements: int = Field(
        4096,
        ge=0,
        description="announcements kept in Redis (the versions hash the broker "
        "checks each group's weight hash against): the newest N, and always batch.max_staleness + 1 at least; "
        "a group of an older version is rejected (weight_hash); 0 keeps every one",
    )
    checkpoint_every: int = Field(
        50,
        ge=0,
        description="steps between checkpoints (weights, optimizer, what was "
        "trained); groups are acknowledged when a checkpoint holds them; 0 = no "
        "checkpoints, acknowledge after every step",
    )


class MetricsConfig(StrictModel):
    """``learner.metrics``: what the learner reports, and where."""

    host: str = Field("127.0.0.1", description="bind address of the /metrics and /healthz server")
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="port of the /metrics and /healthz server; 0 picks a "
        "free one (reported as metrics_port in stats:learner)",
    )
    history: int = Field(
        10_000, ge=100, description="per-step metrics kept in the learner_metrics stream (the dashboard's charts)"
    )
    tensorboard: bool = Field(
        True, description="write every step's scalars as TensorBoard event files to run_dir/tensorboard"
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logging (off by default)")
    rank_checksums: bool = Field(
        False,
        description="every rank appends a checksum of its weights after each step "
        "to run_dir/rank-<r>.checksums (checks that data-parallel ranks stay identical)",
    )


class LearnerConfig(RunConnection, PolicyLossConfig):
    """The learner: what it trains, on what batch, and how often it publishes (and its policy loss)."""

    __renamed__ = RENAMED

    announce_key_file: str = Field(
        "",
        description="file holding the run's private announcement key (Ed25519, "
        "PKCS#8 PEM, mode 0600; relay up writes runs/<id>/secrets/announce.key): the "
        "learner alone signs; needed by announce_auth = ed25519",
    )
    run_dir: str = Field("runs/default", description="folder for the learner's metrics and the built-in model")
    weight_store: str = Field("runs/default/weights", description="weight store folder (shared volume)")
    weights: WeightsConfig = Field(
        default_factory=WeightsConfig,
        description="how versions reach the generators "
        "(relay up: the run's [weights] section, given to the generators too)",
    )
    allow_unauthenticated_bind: bool = Field(
        False,
        description=ALLOW_DESCRIPTION + ": here, the http weight "
        "server or the collective rendezvous on a host that is not loopback with "
        "weights.auth = 'insecure' (which leaves it without the weights key)",
    )
    model: str = Field("tiny", description="'tiny' (built-in random-init model) or a local Hugging Face folder")
    tiny: TinyConfig = Field(default_factory=TinyConfig, description="the built-in tiny model (model = 'tiny')")
    seed: int = Field(0, description="seed for model init and training")
    steps: int = Field(600, ge=1, description="optimizer steps to train")
    target: TargetConfig = Field(default_factory=TargetConfig, description="ending the run early at a reward")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="the optimizer")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="the groups a batch is made of")
    compute: ComputeConfig = Field(default_factory=ComputeConfig, description="threads, micro-batches, memory")
    regularization: RegularizationConfig = Field(
        default_factory=RegularizationConfig, description="KL and entropy terms"
    )
    advantages: AdvantagesConfig = Field(default_factory=AdvantagesConfig, description="the advantage estimator")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="the value model (gae, vtrace)")
    publish: PublishConfig = Field(default_factory=PublishConfig, description="versions, announcements, checkpoints")
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig, description="DeepSpeed engine")
    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="LoRA adapters (off by default; learner.lora.rank=8 turns them on)"
    )
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="metrics, TensorBoard, W&B")

    @model_validator(mode="after")
    def _estimator_needs_a_critic(self) -> LearnerConfig:
        if self.advantages.estimator in NEEDS_CRITIC and not self.critic.enabled:
            valid = ", ".join(a for a in get_args(AdvantageEstimator) if a not in NEEDS_CRITIC)
            raise ValueError(
                f"advantages.estimator {self.advantages.estimator!r} needs a critic (a value model): set "
                f"learner.critic.enabled=true; without one, valid: {valid}"
            )
        return self

    @property
    def loss_scale(self) -> int:
        """T of seq-mean-token-sum-norm: ``loss_scale_tokens``, or the generation budget (0: not known)."""
        return self.loss_scale_tokens or self.batch.max_completion_tokens

    @model_validator(mode="after")
    def _loss_scale_known(self) -> LearnerConfig:
        if self.aggregation == "seq-mean-token-sum-norm" and not self.loss_scale:
            raise ValueError(
                "learner.aggregation = seq-mean-token-sum-norm divides each sequence's loss by a constant T, the "
                "generation budget, which this learner does not know: set learner.loss_scale_tokens (e.g. to the "
                "generators' sampling.max_tokens; relay up sets learner.batch.max_completion_tokens itself)"
            )
        return self

    @model_validator(mode="after")
    def _longest_sequence_fits(self) -> LearnerConfig:
        # micro_batch_tokens bounds the memory of one forward/backward on a rank; a longer sample would be a
        # micro-batch of its own, beyond that bound (out of memory hours into a run): refused here, before
        # anything starts. With sequence parallelism each of k ranks holds ⌈length / k⌉ tokens of it.
        # Only when both lengths are known (relay up sets both; a resumed older run is told only the budget)
        longest = self.batch.max_prompt_tokens + self.batch.max_completion_tokens
        known = self.batch.max_prompt_tokens and self.batch.max_completion_tokens
        k, budget = self.compute.sequence_parallel, self.compute.micro_batch_tokens
        per_rank = -(-longest // k)
        if known and per_rank > budget:
            need_k = -(-longest // budget)
            share = f", {per_rank} tokens per rank over learner.compute.sequence_parallel = {k}" if k > 1 else ""
            raise ValueError(
                f"the longest sequence the generators can make, learner.batch.max_prompt_tokens "
                f"({self.batch.max_prompt_tokens}) + learner.batch.max_completion_tokens "
                f"({self.batch.max_completion_tokens}) = {longest} tokens{share}, does not fit "
                f"learner.compute.micro_batch_tokens ({budget}), the learner's memory bound for one forward and "
                f"backward on a rank: raise learner.compute.micro_batch_tokens to {per_rank} or more (with "
                "learner.compute.gradient_checkpointing if memory is short), or split each sequence over ranks "
                f"with learner.compute.sequence_parallel = {need_k} (relay up --learner-ranks a multiple of it), or "
                "lower the prompts (broker.dataset.max_prompt_tokens) or the generation budget "
                "(generator.sampling.max_tokens, or generator.episodes.max_tokens with an environment) "
                "(docs/learner.md)"
            )
        return self

    @model_validator(mode="after")
    def _sequence_parallel_supported(self) -> LearnerConfig:
        if self.compute.sequence_parallel > 1 and self.critic.enabled:
            raise ValueError(
                f"learner.compute.sequence_parallel = {self.compute.sequence_parallel} with learner.critic.enabled: "
                "the critic's forward is not split over ranks; set learner.compute.sequence_parallel = 1, or use an "
                "estimator without a critic (grpo, drgrpo, rloo, reinforce_pp) (docs/learner.md)"
            )
        return self

    @model_validator(mode="after")
    def _no_open_weight_listener_without_key(self) -> LearnerConfig:
        w = self.weights
        if w.auth == "insecure" and w.transport.listens:
            refuse_open_bind(
                "weights.transport.host",
                w.transport.host,
                w.transport.host,
                f"weights.auth = 'insecure' leaves the {w.transport.type} transport's "
                "listener without the weights key, so anyone who reaches it receives every version",
                "use weights.auth = 'key' with weights.key_file",
                self.allow_unauthenticated_bind,
            )
        return self

    @model_validator(mode="after")
    def _lora_publication(self) -> LearnerConfig:
        if self.lora.publish == "adapter" and self.weights.transport.in_process:
            raise ValueError(
                f"learner.lora.publish = adapter needs weights.transport store or http (the "
                f"{self.weights.transport.type} transport hands over whole models); use learner.lora.publish "
                "= merged or auto"
            )
        return self

    @property
    def lora_adapters_published(self) -> bool:
        """LoRA on and each version published as its adapter alone (learner.lora.publish, ``auto`` resolved)."""
        if not self.lora.rank:
            return False
        return self.lora.publish == "adapter" or (self.lora.publish == "auto" and not self.weights.transport.in_process)

    @model_validator(mode="after")
    def _default_lr(self) -> LearnerConfig:
        # a rate that fits the model: the toy's would make a pretrained LM diverge
        full = (
            (TINY_LR_PER_TOKEN if self.advantages.estimator in NEEDS_CRITIC else TINY_LR)
            if self.model == "tiny"
            else PRETRAINED_LR
        )
        if self.optim.lr is None:
            self.optim.lr = full * (LORA_LR_SCALE if self.lora.rank else 1.0)
        if self.critic.lr is None:  # the critic trains every weight (no adapters)
            self.critic.lr = full if self.lora.rank else self.optim.lr
        if self.critic.deepspeed is None:
            self.critic.deepspeed = self.deepspeed.model_copy()
        return self
