"""``relay up``'s environment: ``RELAY_*`` variables resolved once, here, into the run's configs.

One precedence order: the defaults < the config file < ``RELAY_<FIELD>`` environment variables <
flags and ``--set``. A ``RELAY_<FIELD>[__<SUB>...]`` variable applies to every service whose
config has that field (``RELAY_SAMPLING__TEMPERATURE`` to the generators, ``RELAY_RUN_ID`` to
all four), or stands for a flag (:data:`LAUNCHER_FLAGS`); the result is written to
``runs/<id>/config/*.json`` and the services are started without the variables, so they cannot
override a flag a second time (secrets excepted: :func:`split_secrets`). A variable that names no
field of any service is refused, like an unknown field, unless it is one of :data:`NOT_CONFIG`
(variables of the build, the Makefile and the tests); services started on their own refuse it too.
"""

from __future__ import annotations

import json
import typing

from pydantic import BaseModel

from broker.runtime.config import ConfigError, _parse_value, _set_nested, renamed_path

PREFIX = "RELAY_"

# RELAY_* variables that are not config: never applied to a service, never refused
NOT_CONFIG = {
    "RELAY_ARGS": "extra `relay up` arguments of `make run` (Makefile)",
    "RELAY_IMAGE": "Docker Compose: the Relay image",
    "RELAY_BASE_IMAGE": "Docker Compose: the base image of builds",
    "RELAY_REDIS_IMAGE": "Docker Compose: the Redis image",
    "RELAY_VLLM_IMAGE": "Docker Compose: the vLLM generator's image",
    "RELAY_SGLANG_IMAGE": "Docker Compose: the SGLang server's image",
    "RELAY_MODEL_DIR": "Docker Compose: the SGLang server's model folder",
    "RELAY_SMOLLM2": "benchmarks and tests: a SmolLM2 folder",
    "RELAY_SGLANG_PYTHON": "tests: the interpreter of SGLang's own environment (make test-sglang)",
    "RELAY_BENCH_MASK_CAP": "benchmarks: the SGLang servers' --sampling-mask-max-tokens (benchmarks/sglang_mask.py)",
    "RELAY_CHAOS_SEED": "tests: the chaos test's schedule seed",
    "RELAY_FUZZ_EXAMPLES": "tests: the ingest fuzz test's examples",
    "RELAY_UPDATE_SNAPSHOTS": "tests: rewrite the pinned snapshots",
    "RELAY_CHROMIUM": "tests: the browser of the dashboard tests",
    "RELAY_LISTEN_FDS": (
        "a service started by relay up: the listening sockets relay up bound for it (broker/runtime/ports.py)"
    ),
    "RELAY_LEARNER_NODES": (
        "a rank of a learner across nodes (relay learner --nnodes): rank 0 binds the ranks' store to its node's "
        "address (deploy/launcher/nodes.py)"
    ),
    "RELAY_STALE_EXTENSION_LOCK_S": (
        "learner: age after which a torch extension lock is taken as stale "
        "(ops but the CPU communication op, whose dead holders are seen at once)"
    ),
}

# variables that stand for a `relay up` flag (as in Docker Compose): the flag, when given, wins. Those
# that are also a field name (RELAY_SEED, RELAY_STEPS, RELAY_MODEL) act as the flag: RELAY_SEED seeds
# the broker's task too, RELAY_MODEL's folder is checked like --model's
LAUNCHER_FLAGS = {
    "RELAY_RUN_ID": ("run_id", str),
    "RELAY_REDIS_URL": ("redis_url", str),
    "RELAY_TASK": ("task", str),
    "RELAY_DASHBOARD_PORT": ("dashboard_port", int),
    "RELAY_SEED": ("seed", int),
    "RELAY_STEPS": ("steps", int),
    "RELAY_MODEL": ("model", str),
}


def flag_layer(args, environ: typing.Mapping[str, str]) -> dict[str, dict]:
    """Service -> the overrides of the ``relay up`` flags given (on the command line, else by their
    variable); then the flags not given get their defaults in ``args``."""
    for var, (attr, kind) in LAUNCHER_FLAGS.items():
        if var in environ and getattr(args, attr) is None:
            try:
                setattr(args, attr, kind(environ[var]))
            except ValueError:
                raise ConfigError(f"{var}={environ[var]!r} is not an integer") from None
    flags: dict[str, dict] = {"broker": {}, "reward": {}, "generator": {}, "learner": {}}
    if args.task is not None:
        flags["broker"]["task"] = {"name": args.task}
    if args.model is not None:
        flags["learner"]["model"] = args.model
    if args.steps is not None:
        flags["learner"]["steps"] = args.steps
    if args.backend is not None:
        flags["generator"]["backend"] = {"type": args.backend}
    if args.seed is not None:
        flags["learner"]["seed"] = flags["generator"]["seed"] = args.seed
        flags["broker"].setdefault("task", {})["seed"] = args.seed
    args.task, args.model = args.task or "copy", args.model or "tiny"
    args.backend, args.seed = args.backend or "torch", args.seed if args.seed is not None else 0
    return flags


def _field_models(ann) -> list[type[BaseModel]]:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    return [m for a in typing.get_args(ann) for m in _field_models(a)]


def _names_a_field(model: type[BaseModel], path: list[str]) -> bool:
    """Whether ``path`` (lower-case segments) is a field of ``model`` (through nested sections;
    anything under a free-form table, such as ``plugins.<name>``, counts)."""
    field = model.model_fields.get(path[0])
    if field is None:
        return False
    if len(path) == 1:
        return True
    inner = _field_models(field.annotation)
    if inner:
        return any(_names_a_field(m, path[1:]) for m in inner)
    return typing.get_origin(field.annotation) is dict or field.annotation is dict


def resolve(models: dict[str, type[BaseModel]], environ: typing.Mapping[str, str]) -> dict[str, dict]:
    """Service -> nested overrides from the ``RELAY_*`` variables; unknown ones raise ConfigError."""
    out: dict[str, dict] = {name: {} for name in models}
    unknown = []
    for key in sorted(environ):
        if not key.startswith(PREFIX) or key in NOT_CONFIG or key in LAUNCHER_FLAGS:
            continue
        path = key[len(PREFIX) :].lower().split("__")
        targets = [name for name, model in models.items() if _names_a_field(model, renamed_path(model, path))]
        if not targets:
            unknown.append(key)
        for name in targets:
            _set_nested(out[name], path, _parse_value(environ[key]))
    if unknown:
        raise ConfigError(
            f"environment variable{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: no config "
            f"field of any service has that name (check the spelling: RELAY_<FIELD>, nested with "
            f"__, e.g. RELAY_SAMPLING__TEMPERATURE; docs/config.md lists the fields), or unset it"
        )
    return out


# config fields that hold secrets: kept out of the run's config files, given to the service as these
SECRETS = {
    ("auth_token",): "RELAY_AUTH_TOKEN",
    ("reward_token",): "RELAY_REWARD_TOKEN",
    ("backend", "api_key"): "RELAY_BACKEND__API_KEY",
    ("redis_url",): "RELAY_REDIS_URL",
    ("openai", "api_key"): "RELAY_OPENAI__API_KEY",
}
# secrets of which the file keeps a redacted copy (the URL, its password replaced by ***)
REDACTED = {("redis_url",)}


def split_secrets(cfg: dict) -> tuple[dict, dict]:
    """A service's config without its secrets, and the environment variables that carry them."""
    from broker.client.connection import redact_url

    public, env = json.loads(json.dumps(cfg)), {}
    for path, var in SECRETS.items():
        d = public
        for p in path[:-1]:
            d = d.get(p) if isinstance(d.get(p), dict) else {}
        if d.get(path[-1]):
            value = d.pop(path[-1])
            if path in REDACTED:
                d[path[-1]] = redact_url(value)
            env[var] = json.dumps(value)  # JSON, as the service parses it: a token of digits stays a string
    return public, env


def config_models() -> dict[str, type[BaseModel]]:
    from broker.config import BrokerConfig
    from generators.config import GeneratorConfig
    from learner.config import LearnerConfig
    from reward_service.config import RewardConfig

    return {"broker": BrokerConfig, "reward": RewardConfig, "generator": GeneratorConfig, "learner": LearnerConfig}


def refuse_unknown(environ: typing.Mapping[str, str]) -> None:
    """For a service started on its own: a ``RELAY_*`` variable that names no field of any service
    (nor is listed above) is a ConfigError, as under ``relay up``."""
    resolve(config_models(), environ)


def without_config_vars(environ: typing.Mapping[str, str]) -> dict:
    """The environment for the services: no config variable (the run's config files hold them)."""
    return {k: v for k, v in environ.items() if not k.startswith(PREFIX) or k in NOT_CONFIG}
