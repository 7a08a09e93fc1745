"""``relay up``'s plan: every service's config resolved and validated, and its ports bound and held, before
anything starts (deploy/launcher/up.py ``run_up``: plan -> start -> watch -> report).

Each service's config: the launcher's values (and the flags' defaults) < the config file < ``RELAY_*``
environment variables < the flags given < ``--set`` (deploy/launcher/environment.py). ``--resume`` plans
from the run's recorded configs instead (deploy/launcher/resume.py ``plan_resume``).
"""

from __future__ import annotations

import functools
import os
import secrets
from datetime import datetime
from pathlib import Path

from broker.prompts.tasks import TASK_NEEDS, UnknownTaskError, check_task, task_defaults
from broker.runtime.config import (
    ConfigError,
    deep_merge,
    expand_types,
    format_validation_error,
    migrate,
    read_file,
    set_overrides,
    switch_types,
)
from deploy.launcher.episode_presets import EPISODE_LEARNER_DEFAULTS, episode_defaults, task_reward_defaults
from deploy.launcher.ingest_keys import ingest_key_dir

SERVICES = ("broker", "reward", "generator", "learner")
SHARED = {"weights": ("learner", "generator")}  # run-wide sections, given to each of these services


class UsageError(Exception):
    pass


def _validate(model, data: dict, section: str):
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"[{section}] " + format_validation_error(e)) from None


def _shared_sections(cfg: dict) -> dict:
    """``cfg`` with each run-wide section (``weights``) moved into the services it belongs to:
    ``{"weights": {...}}`` becomes ``{"learner": {"weights": {...}}, "generator": {"weights": {...}}}``,
    under what those services' own sections set (the more specific wins). A transport given as its type alone
    (``weights.transport = "http"``) is spelled out first, so that a service's own ``[learner.weights.transport]``
    merges into it."""
    from deploy.launcher.environment import config_models

    cfg = dict(cfg)
    for name, owners in SHARED.items():
        if name in cfg:
            shared = cfg.pop(name)
            for owner in owners:
                model = config_models()[owner].model_fields[name].annotation
                own = dict(cfg.get(owner, {}))
                own[name] = expand_types(model, own[name]) if name in own else {}
                cfg[owner] = deep_merge({name: expand_types(model, shared)}, own)
    return cfg


def plan(args, environ: dict | None = None) -> dict:
    """Validate everything before starting anything; return the per-service configs and ports.

    Each service's config: the launcher's values (and the flags' defaults) < the config file <
    ``RELAY_*`` environment variables < the flags given < ``--set`` (deploy/launcher/environment.py)."""
    from deploy.launcher import environment
    from deploy.launcher.openai_key import endpoint_key
    from deploy.launcher.producers import producer_ids
    from deploy.launcher.run_secrets import LAUNCHER_USER

    environ = os.environ if environ is None else environ
    if getattr(args, "resume", None):
        from deploy.launcher.resume import plan_resume

        return plan_resume(args, environ, UsageError)
    env_over = environment.resolve(environment.config_models(), environ)
    flags = environment.flag_layer(args, environ)  # the flags given (and their variables), above the environment

    _check_flags(args)
    if "model" in flags["learner"]:  # given as --model or RELAY_MODEL: recorded as the resolved folder
        flags["learner"]["model"] = args.model
    http_port = _dashboard_port(args)

    run_id = args.run_id or datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
    runs_dir = Path(args.runs_dir).resolve()
    run_dir = runs_dir / run_id
    if run_dir.exists():
        raise UsageError(f"run folder {run_dir} already exists; choose another --run-id")
    file_cfg, over = _user_layers(args)

    redis_port, users, redis_url = _redis(args, run_id)
    section = functools.partial(_section, (file_cfg, env_over, flags, over))
    configs, ours = _service_configs(args, section, run_id, run_dir, http_port, redis_url)
    broker, reward, learner, generator = configs
    openai_key = endpoint_key(generator, run_dir)  # the OpenAI endpoint's per-run key (deploy/launcher/openai_key.py)
    checked = _validate_all(broker, reward, learner, generator, args.learner_ranks)
    p = {
        "run_id": run_id,
        "run_dir": run_dir,
        "runs_dir": runs_dir,
        "http_port": http_port,
        "redis_url": redis_url(LAUNCHER_USER),
        "redis_port": redis_port,
        "redis_users": users,
        "broker": broker,
        "reward": reward,
        "learner": learner,
        "generator": generator,
        "learner_config": checked["learner"],  # the learner's settings with their defaults (steps, checkpoints)
        "openai_key": openai_key,
        "generator_ids": [f"gen-{i}" for i in range(args.generators)],
        "producer_ids": producer_ids(args.producers or 0),
    }
    # the ports relay up chose (not the user) move to free ones if taken before they are held, now
    return hold_ports(p, ours)


def _service_configs(args, section, run_id: str, run_dir: Path, http_port: int, redis_url) -> tuple[tuple, set]:
    """The four services' configs (broker, reward, learner, generator; ``section``: the layers above the
    launcher's values, :func:`_section`), each service told where the others are; and which of the
    ports (``http``, ``ingest``, ``reward``) relay up chose, not the user."""
    from broker.client.connection import connect_host
    from deploy.launcher.procs import free_port
    from deploy.launcher.run_secrets import run_key_fields
    from deploy.launcher.run_tokens import new_token

    common = {"run_id": run_id}
    keyed = run_key_fields(run_dir)  # the learner signs announcements, the others check; who may read weights
    keydir = ingest_key_dir(run_dir)  # written by run_up (write_ingest_keys), one certificate per generator
    default_bind = f"tcp://127.0.0.1:{free_port()}"
    broker = section(
        "broker",
        {
            **common,
            **keyed["broker"],
            "redis_url": redis_url("broker"),
            "ingest_bind": default_bind,
            "http_port": http_port,
            "ingest_key_file": str(keydir / "broker.key_secret"),
            "ingest_clients_file": str(keydir / "clients.json"),
            "task": {**task_defaults(args.task), "name": args.task, "seed": args.seed},
        },
    )
    needs = TASK_NEEDS.get(args.task, {})  # a multi-turn task: its environment, the tiny model's tool vocabulary
    # a bearer token per run: /score answers only the run's generators (deploy/launcher/run_tokens.py)
    reward_port = free_port()
    reward = section("reward", {"port": reward_port, "auth_token": new_token(), **task_reward_defaults(args.task)})
    # the generators reach the broker and the reward service where they are, overrides included
    ingest, default_bind = _ingest_addresses(broker, default_bind)
    reward_url = f"http://{connect_host(str(reward.get('host', '127.0.0.1')), '127.0.0.1')}:{reward.get('port')}"
    learner = section(
        "learner",
        {
            **common,
            **keyed["learner"],
            "redis_url": redis_url("learner"),
            "run_dir": str(run_dir / "learner"),
            "weight_store": str(run_dir / "weights"),
            "model": args.model,
            "seed": args.seed,
            **({"tiny": {"tools": True}} if needs.get("tools") else {}),
            **(EPISODE_LEARNER_DEFAULTS if needs.get("env") else {}),
        },
    )
    episodes = episode_defaults(
        needs, broker.get("task", {}).get("max_digits"), learner.get("batch", {}).get("groups"), args.generators
    )
    generator = section(
        "generator",
        {
            **common,
            **keyed["generator"],
            "redis_url": redis_url("generator"),
            "broker_address": ingest,
            "weight_store": learner.get("weight_store", ""),
            "backend": {"type": args.backend},
            "ingest_auth": broker.get("ingest_auth", "curve"),
            "broker_public_key_file": str(keydir / "broker.key"),
            "reward": {"url": reward_url},
            "seed": args.seed,
            **episodes,
        },
    )
    _join(learner, generator, reward)
    ours = {
        name
        for name, chosen in (
            ("http", args.dashboard_port in (None, 0) and broker["http_port"] == http_port),
            ("ingest", broker.get("ingest_bind") == default_bind),
            ("reward", reward.get("port") == reward_port),
        )
        if chosen
    }
    return (broker, reward, learner, generator), ours


def _section(layers: tuple[dict, dict, dict, dict], name: str, base: dict) -> dict:
    """Service ``name``'s config: ``base`` (the launcher's values) under the config file's section, the
    environment's, the flags' and ``--set``'s, in that order; a renamed key of a layer is moved to its new
    place before that layer is merged, so a ``--set`` of the old name overrides a file's new one."""
    from deploy.launcher.environment import config_models

    model = config_models()[name]
    try:
        for layer in (layers[0].get(name, {}), layers[1][name], layers[2][name], layers[3].get(name, {})):
            layer = migrate(model, layer)  # renamed keys, each layer on its own (docs/config.md)
            base = deep_merge(switch_types(model, base, layer), layer)  # another type replaces a section
        return migrate(model, base, final=True)  # an old section whose type came from another layer (weights.http)
    except ValueError as e:  # one setting under its old and its new name
        raise ConfigError(f"[{name}] {e}") from None


def _redis(args, run_id: str):
    """(the embedded redis-server's port, its users, user -> Redis URL): one user (and password) per service
    on the embedded Redis; an external one (``--redis-url``, port and users None): the URL as given."""
    from deploy.launcher.procs import free_port
    from deploy.launcher.producers import producer_ids
    from deploy.launcher.run_secrets import RedisUsers

    port = None if args.redis_url else free_port()
    users = RedisUsers.new(run_id, producer_ids(args.producers or 0)) if port is not None else None
    return port, users, lambda user: users.url(user, port) if users is not None else args.redis_url


def _user_layers(args) -> tuple[dict, dict]:
    """The config file's sections and ``--set``'s, each run-wide section moved into its services."""
    file_cfg = _shared_sections(read_file(args.config) if args.config else {})
    unknown = set(file_cfg) - set(SERVICES)
    if unknown:
        raise UsageError(
            f"config file sections {sorted(unknown)} unknown; valid: {', '.join(SERVICES + tuple(SHARED))}"
        )
    over = _shared_sections(set_overrides(args.set))
    unknown = set(over) - set(SERVICES)
    if unknown:
        raise UsageError(
            f"--set must start with a service name or a run-wide section "
            f"({', '.join(SERVICES + tuple(SHARED))}), got {sorted(unknown)}"
        )
    return file_cfg, over


def _ingest_addresses(broker: dict, default_bind: str) -> tuple[str, str]:
    """Where the generators reach the broker's ingest (its workers' addresses, comma-separated), and the
    default bind address (moved to a run of free ports when there are several workers: worker k binds
    port + k)."""
    from broker.client.connection import connect_address, worker_addresses
    from deploy.launcher.procs import free_port_run

    workers = broker.get("ingest_workers", 1)
    workers = workers if isinstance(workers, int) and workers >= 1 else 1  # a bad value: BrokerConfig says so
    if workers > 1 and broker.get("ingest_bind") == default_bind:
        broker["ingest_bind"] = default_bind = f"tcp://127.0.0.1:{free_port_run(workers)}"
    try:
        return ",".join(
            worker_addresses(connect_address(str(broker.get("ingest_bind", "")), "127.0.0.1"), workers)
        ), default_bind
    except ValueError as e:
        raise ConfigError(f"[broker] ingest_workers = {workers}: {e}") from None


def _join(learner: dict, generator: dict, reward: dict) -> None:
    """What the generators take from the others' sections: the http transport's fixed weight port (no
    shared folder), the reward service's token; and the tiny model vLLM's CPU attention runs."""
    from deploy.launcher.procs import free_port
    from deploy.launcher.run_secrets import pin_weight_port

    if generator.get("weights", {}).get("transport", {}).get("type") == "http":
        generator["weight_store"] = ""  # no shared folder: versions are fetched from the learner's weight server
        pin_weight_port(learner, generator, free_port)  # ...which the generators name: it gets a fixed port
    if generator.get("backend", {}).get("type") in ("vllm", "sglang"):
        # the built-in model with heads vLLM's CPU attention runs (a Llama): the one SGLang's CPU engine was run on
        learner.setdefault("tiny", {}).setdefault("vllm_compatible", True)
    if reward.get("auth_token") and not generator.get("reward_token"):
        generator["reward_token"] = reward["auth_token"]  # the reward service's bearer token, for its callers


def _validate_all(broker: dict, reward: dict, learner: dict, generator: dict, ranks: int) -> dict:
    """Every service's config validated, once, here: name -> its model (ConfigError naming the section)."""
    from broker.config import BrokerConfig
    from deploy.launcher.preflight import Context
    from generators.config import GeneratorConfig
    from learner.config import LearnerConfig
    from reward_service.app import RewardConfig

    checked = {
        name: _validate(model, data, name)
        for model, data, name in (
            (BrokerConfig, broker, "broker"),
            (RewardConfig, reward, "reward"),
            (GeneratorConfig, generator, "generator"),
        )
    }
    # a budget past the model's context is a more fundamental mistake than one past the learner's micro-batch
    # (which LearnerConfig refuses): reported first (PreflightError; check_run makes the same check again)
    model = learner.get("model", LearnerConfig.model_fields["model"].default)
    if isinstance(model, str):  # anything else: a mistake LearnerConfig names
        Context(model, checked["generator"])
    _sequence_limits(learner, checked["broker"], checked["generator"])
    checked["learner"] = _validate(LearnerConfig, learner, "learner")
    batch = checked["learner"].batch.groups
    if batch % ranks:
        raise UsageError(f"learner.batch.groups ({batch}) must be a multiple of --learner-ranks ({ranks})")
    k = checked["learner"].compute.sequence_parallel
    if ranks % k:
        raise UsageError(
            f"learner.compute.sequence_parallel ({k}) must divide --learner-ranks ({ranks}): the ranks are "
            f"data-parallel groups of {k}, each sequence split over one group"
        )
    return checked


def _sequence_limits(learner: dict, broker, generator) -> None:
    """What the learner is told of the sequences it will train (``learner.batch``, unless the user set them):
    the generators' budget after the prompt (:func:`fill_generation_budget`) and the longest prompt the broker
    hands out (with the budget, the longest sequence a micro-batch holds)."""
    from broker.prompts.tasks import longest_prompt_tokens

    batch = fill_generation_budget(learner, generator)
    if batch is not None:
        prompt = broker.dataset.max_prompt_tokens if broker.dataset is not None else longest_prompt_tokens(broker.task)
        batch.setdefault("max_prompt_tokens", prompt)


def fill_generation_budget(learner: dict, generator) -> dict | None:
    """``learner.batch.max_completion_tokens``, unless set: the generators' (``generator``, a GeneratorConfig)
    budget after the prompt, T of seq-mean-token-sum-norm when learner.loss_scale_tokens = 0. Used by the plan
    and by ``--resume`` of a run recorded before the learner was told it (deploy/launcher/resume.py). Returns
    the learner's batch section (None when it is not a table: a mistake LearnerConfig names)."""
    batch = learner.setdefault("batch", {})
    if not isinstance(batch, dict):
        return None
    batch.setdefault("max_completion_tokens", generator.generation_budget[0])
    return batch


def _check_flags(args) -> None:
    """The flags' own values (the task, counts, the model folder: ``args.model`` resolved; the counts'
    defaults filled in) and a ``redis-server`` to run when no ``--redis-url`` is given; UsageError naming
    the flag."""
    from deploy.launcher.procs import find_redis_server
    from learner.model_folder import ModelFolderError, check_model_folder

    args.generators = 2 if args.generators is None else args.generators
    args.learner_ranks = 1 if args.learner_ranks is None else args.learner_ranks
    args.learner_nodes = 1 if getattr(args, "learner_nodes", None) is None else args.learner_nodes

    try:
        check_task(args.task)
    except UnknownTaskError as e:
        raise UsageError(str(e)) from None
    if args.generators < 1 or (args.producers or 0) < 0:
        raise UsageError("--generators must be at least 1" if args.generators < 1 else "--producers must be 0 or more")
    if args.learner_ranks < 1:
        raise UsageError("--learner-ranks must be at least 1")
    if args.learner_nodes < 1 or args.learner_ranks % args.learner_nodes:
        raise UsageError("--learner-nodes must be at least 1 and divide --learner-ranks")
    if args.max_restarts < 0:
        raise UsageError("--max-restarts must be 0 or more")
    if getattr(args, "fail_after", 0) < 0:
        raise UsageError("--fail-after must be 0 (never) or more seconds")
    try:
        args.model = str(check_model_folder(args.model))
    except ModelFolderError as e:
        raise UsageError(str(e)) from None
    if args.redis_url is None:
        find_redis_server()  # fails early with the install hint


def _dashboard_port(args) -> int:
    """The broker's HTTP port: 8080, or a free one if 8080 is taken (``--dashboard-port`` 0: any free one)."""
    from deploy.launcher.procs import free_port, port_in_use

    if args.dashboard_port is None:
        return 8080 if not port_in_use(8080) else free_port()
    if args.dashboard_port == 0:
        return free_port()
    if port_in_use(args.dashboard_port):
        raise UsageError(
            f"port {args.dashboard_port} is in use (--dashboard-port); pick another or 0 for any free port"
        )
    return args.dashboard_port


def hold_ports(p: dict, movable: set[str]) -> dict:
    """``p`` with its services' ports bound and held (``p["listeners"]``, deploy/launcher/listeners.py)."""
    from deploy.launcher.listeners import PortTaken, hold_service_ports

    try:
        p["listeners"] = hold_service_ports(p, movable)
    except PortTaken as e:
        raise UsageError(str(e)) from None
    return p
