"""``docs/config.md``: every config field of every service, generated from the pydantic models.

    .venv/bin/relay config docs > docs/config.md     (or: python -m deploy.configdoc > docs/config.md)

tests/unit/deploy/test_config_docs.py regenerates it and fails when the committed file is stale.
Also ``relay config show RUN``: the effective config of a run, from ``runs/<RUN>/config/*.json``.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path

import annotated_types as at
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

HEADER = """\
# Configuration reference

Generated from the services' pydantic models by `relay config docs > docs/config.md` (a test fails
when this file is stale); do not edit by hand.

Every service (`relay broker`, `relay reward`, `relay generator`, `relay learner`) takes its fields
from, in increasing precedence: the defaults below, `--config FILE` (TOML or JSON), environment
variables `RELAY_<FIELD>` (nested fields joined with `__`: `RELAY_SAMPLING__TEMPERATURE=0.7`), and
`--set field.sub=value` (values parsed as JSON when they parse, else taken as strings). Unknown
fields are errors, and so is a `RELAY_*` variable that names no field of any service (the few that
are not config, such as `RELAY_ARGS` of `make run`, are listed in `deploy/launcher/environment.py`).
A number field takes finite values only: NaN and ±inf (`inf` in TOML, `Infinity` in JSON) are errors
that name the field; where a field may be unbounded, it says so and takes `null`.
A service on its own uses the paths below without the service's name (`relay generator --set
sampling.temperature=0.7`); `relay up` takes them with it (`--set
generator.sampling.temperature=0.7`, or `[generator.sampling]` in its config file).

`relay up` resolves the environment once, itself, in the same order: `RELAY_<FIELD>` applies to
every service that has the field (`RELAY_SAMPLING__TEMPERATURE` to the generators), the variables
of its flags (`RELAY_STEPS`, `RELAY_SEED`, `RELAY_MODEL`, `RELAY_TASK`, `RELAY_RUN_ID`,
`RELAY_REDIS_URL`, `RELAY_DASHBOARD_PORT`) act as those flags, a flag given (`--steps`, `--model`,
`--task`, `--seed`, `--backend`) or `--set` overrides them. A layer that names another backend type
than the one below it (`--backend vllm`, or `--set generator.backend.type=vllm`, over a file's
`type = "torch"`) replaces that backend section instead of merging into it: the torch fields of the
file (`threads`) do not carry over to vLLM, whose own fields come from the same layer or later
ones; so does a layer naming another weight transport (`--set weights.transport=store` over a file's
`[weights.transport] type = "http"`), and so do a service's own layers when it is started alone. A section chosen by its type may be given as the type alone
(`--set weights.transport=http`, `RELAY_WEIGHTS__TRANSPORT=http`): that type with its defaults, and
fields set beside it merge in. The result, every value set by the
launcher, the file, the environment or a flag, is written to `runs/<run-id>/config/<service>.json`;
the services read it from there and are started without the variables, except the secrets
(`auth_token`, `reward_token`, `backend.api_key`): those never go into a file, each service gets
its own as `RELAY_AUTH_TOKEN`, `RELAY_REWARD_TOKEN`, `RELAY_BACKEND__API_KEY`. `relay config show
RUN` prints a run's config with every default filled in (a secret set in a file shows as `(set)`).

Bounds: `≥`, `>`, `≤`, `<` on numbers; `pattern` on strings. `required`: no default.
"""


def services() -> list[tuple[str, type[BaseModel]]]:
    from broker.config import BrokerConfig
    from generators.config import GeneratorConfig
    from learner.config import LearnerConfig
    from reward_service.config import RewardConfig

    return [
        ("broker", BrokerConfig),
        ("reward", RewardConfig),
        ("generator", GeneratorConfig),
        ("learner", LearnerConfig),
    ]


def _models_in(ann) -> list[type[BaseModel]]:
    """The config models a field holds directly (``X``, ``X | None``, a union of backends)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(ann)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(ann) for m in _models_in(a)]
    return []


def type_name(ann) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]" if args else origin.__name__
    if ann is typing.Any:
        return "any"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "table"
    return getattr(ann, "__name__", str(ann))


def default_text(field) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, str):  # computed per process (a replica id from the host name)
            return "computed"
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "table"
    return "`" + json.dumps(value).replace("|", "\\|") + "`"


def bounds_text(field) -> str:
    out = []
    for m in field.metadata:
        for attr, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if isinstance(m, getattr(at, {"ge": "Ge", "gt": "Gt", "le": "Le", "lt": "Lt"}[attr])):
                out.append(f"{sym} {getattr(m, attr)}")
        if getattr(m, "pattern", None):
            out.append(f"pattern `{m.pattern}`")
    return ", ".join(out)


def _cell(text: str) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def model_sections(path: str, model: type[BaseModel], title: str = "") -> list[str]:
    """A table of the model's own fields under ``path``, then one section per nested model."""
    lines = [f"### `[{path}]`" + (f" {title}" if title else ""), ""]
    if model.__doc__:
        lines += [_cell(model.__doc__.strip().split("\n\n")[0]), ""]
    lines += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    nested = []
    for name, f in model.model_fields.items():
        lines.append(
            f"| `{path}.{name}` | {type_name(f.annotation)} | {default_text(f)} | {bounds_text(f)} | "
            f"{_cell(f.description)} |"
        )
        inner = _models_in(f.annotation)
        if len(inner) == 1:
            nested.append((f"{path}.{name}", inner[0], ""))
        for m in inner if len(inner) > 1 else []:  # a union chosen by its ``type``
            nested.append((f"{path}.{name}", m, f"with `type = {json.dumps(m.model_fields['type'].default)}`"))
        args = typing.get_args(f.annotation)
        if typing.get_origin(f.annotation) is dict and args and _models_in(args[-1]):
            nested.append((f"{path}.{name}.<name>", _models_in(args[-1])[0], ""))
    lines.append("")
    for p, m, t in nested:
        lines += model_sections(p, m, t)
    return lines


def plugin_sections() -> list[str]:
    """The options of every built-in reward plugin (``[reward.plugins.<name>]`` with ``type = ...``)."""
    from reward_service.plugins import REGISTRY, NoOptions

    lines = [
        "## Reward plugin options",
        "",
        "A plugin instance `[reward.plugins.<name>]` takes `type` and `options`; these are the options of "
        "each built-in type (docs/rewards.md explains them).",
        "",
    ]
    for name, cls in sorted(REGISTRY.items()):
        if not cls.__module__.startswith("reward_service.") or cls.Options is NoOptions:
            continue
        lines += model_sections("reward.plugins.<name>.options", cls.Options, f'with `type = "{name}"`')
    none = sorted(
        n for n, c in REGISTRY.items() if c.__module__.startswith("reward_service.") and c.Options is NoOptions
    )
    lines += [f"Types without options: {', '.join(f'`{n}`' for n in none)}.", ""]
    return lines


def _renamed(path: str, model: type[BaseModel]) -> list[tuple[str, str, str]]:
    """(old path, new path, when) of every key that moved, in ``model`` (its ``__renamed__`` and
    ``__renamed_by_type__``) and its sections."""
    out = [(f"{path}.{old}", f"{path}.{new}", "") for old, new in getattr(model, "__renamed__", {}).items()]
    out += [
        (f"{path}.{old}.*", f"{path}.{new}.*", f'with `{new}.type = "{kind}"` (ignored with another type)')
        for old, (new, kind) in getattr(model, "__renamed_by_type__", {}).items()
    ]
    for name, f in model.model_fields.items():
        for m in dict.fromkeys(_models_in(f.annotation)):
            out += _renamed(f"{path}.{name}", m)
    return list(dict.fromkeys(out))


def renamed_sections() -> list[str]:
    """The "Renamed keys" table: what an older config says, and what to write now."""
    lines = [
        "## Renamed keys",
        "",
        "Keys that moved into sections (issue 41: no config class holds more than 20 fields). The old spelling "
        "still works, in a config file, a `RELAY_*` variable (`RELAY_BATCH_GROUPS`) and `--set` (`relay up --set "
        "learner.lr=1e-3`): it is moved to the new place, with one warning naming the new spelling. Giving both "
        "spellings of one key in the same place (one file, or the `--set`s) is an error; a later layer's old "
        "spelling overrides an earlier layer's new one (a `--set learner.lr` over a file's `[learner.optim] lr`). "
        "A recorded run (`relay up --resume`) is read the same way.",
        "",
        "The transports' sections `weights.http` and `weights.collective` became `weights.transport`, one section "
        "chosen by its `type` (docs/weights.md): an old section is moved there when the transport's type is its own "
        "and ignored otherwise (its settings never applied to another transport), with one warning; which type "
        "counts is decided once every layer is merged (a file's `[weights.http]` under a `--set "
        "weights.transport=http`), and an old key given beside the same key of `weights.transport` is an error "
        'whatever the layers. `weights.transport = "http"`, the type alone, is no old spelling: it is short for '
        '`[weights.transport] type = "http"` with that transport\'s defaults (`--set weights.transport=http`).',
        "",
        "| old key | new key | when |",
        "|---|---|---|",
    ]
    for name, model in services():
        lines += [f"| `{old}` | `{new}` | {when} |" for old, new, when in _renamed(name, model)]
    return lines + [""]


def render() -> str:
    lines = [HEADER]
    for name, model in services():
        lines += [f"## {name}", ""]
        lines += model_sections(name, model)
    lines += renamed_sections()
    lines += plugin_sections()
    return "\n".join(lines).rstrip() + "\n"


class ShowError(Exception):
    pass


def show(run: str, runs_dir: str = "runs") -> str:
    """The effective config of a run: each ``config/<service>.json`` validated, the defaults filled in
    (secrets masked)."""
    from broker.runtime.config import ConfigError, load_config

    folder = Path(run) if Path(run).is_dir() and (Path(run) / "config").is_dir() else Path(runs_dir) / run
    cfg_dir = folder / "config"
    if not cfg_dir.is_dir():
        raise ShowError(
            f"{folder} has no config/ folder: not a run folder (give a run id under {runs_dir}/, "
            f"'latest', or a run folder)"
        )
    models = dict(services())
    out = []
    for path in sorted(cfg_dir.glob("*.json")):
        model = models.get(path.stem.split("-")[0])
        if model is None:
            continue
        try:
            cfg = load_config(model, path, environ={})
        except ConfigError as e:
            raise ShowError(f"{path}: {e}") from None
        out.append(f"# {path}\n" + json.dumps(_masked(cfg.model_dump(mode="json")), indent=1))
    if not out:
        raise ShowError(f"{cfg_dir} holds no service config")
    return "\n\n".join(out) + "\n"


SECRETS = {"auth_token", "reward_token", "api_key"}  # printed as "(set)", never their value


def _masked(d):
    if isinstance(d, dict):
        return {k: "(set)" if k in SECRETS and v else _masked(v) for k, v in d.items()}
    return [_masked(x) for x in d] if isinstance(d, list) else d


def add_config_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser(
        "docs",
        help="print docs/config.md (every field of every service) to stdout",
        description="Print the configuration reference (docs/config.md), generated from the models.",
    )
    s = sub.add_parser(
        "show",
        help="print a run's effective config (every field, defaults filled in)",
        description="Print the effective config of a run: each runs/<RUN>/config/<service>.json "
        "validated, with every default filled in.",
    )
    s.add_argument("run", metavar="RUN", help="a run id under --runs-dir, 'latest', or a run folder")
    s.add_argument("--runs-dir", default="runs", help="folder that holds the run folders (default: runs)")


def run_config(args) -> int:
    if args.action == "docs":
        sys.stdout.write(render())
        return 0
    try:
        sys.stdout.write(show(args.run, args.runs_dir))
    except ShowError as e:
        print(f"relay config show: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.stdout.write(render())
