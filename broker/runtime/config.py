"""Config loading shared by every service: pydantic models, a file, environment overrides.

A service's config is one pydantic model (``extra="forbid"``: unknown keys are errors). Values
come from, in increasing precedence: the model's defaults, a JSON or TOML file, environment
variables ``RELAY_<FIELD>`` (nested fields joined with ``__``, e.g.
``RELAY_SAMPLING__TEMPERATURE=0.7``), and explicit overrides from the command line. docs/config.md
lists every field (deploy/configdoc.py generates it); ``relay up`` resolves the environment itself
(deploy/launcher/environment.py) and starts the services without it.

This module imports no torch: ``--help`` and validation stay fast.
"""

from __future__ import annotations

import json
import logging
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

T = TypeVar("T", bound=BaseModel)
log = logging.getLogger("relay.config")

RENAMED_DOC = "docs/config.md, Renamed keys"
_warned: set[tuple[str, str]] = set()  # (model, old key): each renamed key is warned about once per process


def _pop_path(d: dict, path: list[str], new: list[str]) -> tuple[bool, Any]:
    """Take the value at ``path`` out of ``d`` (whose dicts on the way are copies): (found, value). A value
    that is itself the new section (``new`` goes on below ``path``, and it is a dict or a model) is no old
    spelling."""
    for p in path[:-1]:
        if not isinstance(d.get(p), dict):
            return False, None
        d[p] = d = dict(d[p])
    if path[-1] not in d or (new[: len(path)] == path and isinstance(d[path[-1]], (dict, BaseModel))):
        return False, None
    return True, d.pop(path[-1])


def _has_path(d: dict, path: list[str]) -> bool:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return False
        d = d[p]
    return True


def move_renamed(data: Any, renamed: Mapping[str, str], owner: str) -> Any:
    """``data`` (a model's input) with each key that ``renamed`` lists (old dotted path -> new dotted path,
    relative to the model) moved to its new place, so that configs, ``--set`` and ``RELAY_*`` variables
    written before a field moved keep working: one warning per key names the new spelling; the old and the
    new spelling of one setting given together is a ValueError (which one would win is anyone's guess)."""
    if not isinstance(data, dict) or not renamed:
        return data
    out = dict(data)
    for old, new in renamed.items():
        new_path = new.split(".")
        found, value = _pop_path(out, old.split("."), new_path)
        if not found:
            continue
        if _has_path(out, new_path):
            raise ValueError(
                f"{owner}: {old} and {new} are one setting ({new} is its new name, {RENAMED_DOC}): give only {new}"
            )
        _set_nested(out, new_path, value, copy=True)
        if (owner, old) not in _warned:
            _warned.add((owner, old))
            log.warning("%s: %s was renamed %s (%s); the old name still works, for now", owner, old, new, RENAMED_DOC)
    return out


def _section_models(ann) -> list[type[BaseModel]]:
    """The config models a field holds (``X``, ``X | None``, a discriminated union of them)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    return [m for a in typing.get_args(ann) for m in _section_models(a)]


def expand_types(model: type[BaseModel], data: Any) -> Any:
    """``data`` with each section chosen by its type (a discriminated union, such as ``weights.transport`` or
    ``backend``) given as a plain string spelled out: ``"http"`` is ``{"type": "http"}``, that type with its
    defaults (the short spelling, no warning: ``--set weights.transport=http``)."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, field in model.model_fields.items():
        if isinstance(field.discriminator, str) and isinstance(out.get(name), str):
            out[name] = {field.discriminator: out[name]}
    return out


def _type_of(model: type[BaseModel], name: str, section: Any, final: bool) -> str | None:
    """The type section ``name`` of ``model`` is given (None when it says none: in one layer of several the
    type may come from another), or with ``final`` (the layers merged) the type it defaults to."""
    key = model.model_fields[name].discriminator
    if isinstance(section, BaseModel):
        return getattr(section, key)
    if isinstance(section, dict) and key in section:
        return section[key]
    if not final:
        return None
    field = model.model_fields[name]
    default = field.default_factory() if field.default_factory is not None else field.default
    return getattr(default, key, None)


def move_by_type(model: type[BaseModel], data: Any, final: bool) -> Any:
    """``data`` with each old section that ``model.__renamed_by_type__`` lists (old key -> (the section chosen
    by its type that replaced it, the type it belongs to)) moved into that section when its type is the old
    section's, and dropped otherwise (its settings never applied to another type), one warning per key. In one
    layer of several (not ``final``) an old section moves only when the layer names its type; otherwise it
    waits for the layers to be merged, as another layer may name it (``final``: the whole config, where the
    default type counts). An old key given with the same key of the new section is a ValueError, as in
    :func:`move_renamed`."""
    moves = getattr(model, "__renamed_by_type__", {})
    if not isinstance(data, dict) or not moves:
        return data
    out, owner = dict(data), model.__name__
    for old, (new, kind) in moves.items():
        key = model.model_fields[new].discriminator
        chosen = _type_of(model, new, out.get(new), final) if isinstance(out.get(old), dict) else None
        if chosen is None or (chosen != kind and not final):
            continue
        value, section = out.pop(old), out.get(new)
        if isinstance(section, BaseModel):
            section = {**section.model_dump(exclude_unset=True), key: chosen}
        renamed = f'{old}.* was renamed {new}.* (with {new}.{key} = "{kind}")'
        if chosen == kind:
            both = sorted(set(value) & set(section or {}))
            if both:
                raise ValueError(
                    f"{owner}: {old}.{both[0]} and {new}.{both[0]} are one setting ({new}.{both[0]} is its new "
                    f"name, {RENAMED_DOC}): give only {new}.{both[0]}"
                )
            out[new] = {key: kind, **(section or {}), **value}
            said = f"{renamed} ({RENAMED_DOC}); the old name still works, for now"
        else:
            said = f'{renamed}; ignored here: {new}.{key} is "{chosen}" ({RENAMED_DOC})'
        if (owner, old) not in _warned:
            _warned.add((owner, old))
            log.warning("%s: %s", owner, said)
    return out


def migrate_own(model: type[BaseModel], data: Any, final: bool = True) -> Any:
    """``data`` for ``model`` in today's spelling, the model's own keys (not its sections'): its renamed keys
    moved (:func:`move_renamed`), a section chosen by its type given as a string spelled out
    (:func:`expand_types`), the old sections of such a section moved into it (:func:`move_by_type`)."""
    data = move_renamed(data, getattr(model, "__renamed__", {}), model.__name__)
    return move_by_type(model, expand_types(model, data), final)


def migrate(model: type[BaseModel], data: Any, final: bool = False) -> Any:
    """``data`` for ``model`` in today's spelling, its sections' included (:func:`migrate_own`): each layer
    of a config (file, variables, ``--set``) is migrated on its own before they are merged, so that a ``--set``
    of the old name overrides a file's new one instead of clashing with it; ``final``: ``data`` is the whole
    config (the layers merged, or a recorded run), so an old section whose type no layer named is settled too."""
    data = migrate_own(model, data, final)
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, field in model.model_fields.items():
        if isinstance(out.get(name), dict):
            for section in _section_models(field.annotation):
                out[name] = migrate(section, out[name], final)
    return out


def renamed_path(model: type[BaseModel], path: list[str]) -> list[str]:
    """``path`` (a field's segments) in its new spelling, through the renamed keys of ``model`` and of its
    sections (``weights.http.port`` is ``weights.transport.port``)."""
    for old, new in getattr(model, "__renamed__", {}).items():
        old_path = old.split(".")
        if path[: len(old_path)] == old_path:
            path = new.split(".") + path[len(old_path) :]
            break
    moved = getattr(model, "__renamed_by_type__", {}).get(path[0]) if path else None
    if moved is not None:
        path = [moved[0], *path[1:]]
    field = model.model_fields.get(path[0]) if path else None
    if field is None or len(path) == 1:
        return path
    for section in _section_models(field.annotation):
        inner = renamed_path(section, path[1:])
        if inner != path[1:]:
            return [path[0], *inner]
    return path


class StrictModel(BaseModel):
    """Base for every config model: unknown fields are rejected, assignments validated, and NaN and
    ±inf refused in every float field (no field of Relay's config has a meaning for them: an unbounded
    value is spelled ``null`` where a field allows it, e.g. ``learner.correction.tis_cap``).

    A model whose fields moved lists them in ``__renamed__`` (old dotted path -> new one), and old sections
    that became one section chosen by its type in ``__renamed_by_type__`` (old key -> (that section, the type
    the old one belongs to)): the old keys keep working, with a warning (:func:`migrate_own`; docs/config.md,
    "Renamed keys"). A section chosen by its type may be given as the type alone (``weights.transport =
    "http"``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    __renamed__: typing.ClassVar[Mapping[str, str]] = {}
    __renamed_by_type__: typing.ClassVar[Mapping[str, tuple[str, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        return migrate_own(cls, data, final=True)


class RunConnection(StrictModel):
    """The fields of every service that joins a run through its Redis (broker, learner, generators):
    the run, the Redis URL and whether announcements are signed (the learner signs with the run's private
    key, :class:`VerifyingConnection`'s services check with its public key)."""

    run_id: str = Field("default", description="run id; namespaces every Redis key")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis server URL: redis://[user:password@]"
        "host:port/db, rediss:// for TLS, or unix://; the password is a secret (give it as "
        "RELAY_REDIS_URL; relay up never writes it to the run folder, shows it redacted)",
    )
    announce_auth: Literal["ed25519", "insecure"] = Field(
        "ed25519",
        description="ed25519: weight announcements signed by the learner with the run's private key and "
        "checked by the broker and the generators with its public key (docs/security.md); insecure: neither signed "
        "nor checked (anyone who can write to Redis chooses the weights the generators load)",
    )

    @field_validator("announce_auth", mode="before")
    @classmethod
    def _no_hmac(cls, v):
        if v == "hmac":
            raise ValueError(
                "'hmac' was removed: every generator held the HMAC key, so any of them could sign a "
                "version; use 'ed25519' (the learner alone holds the private key; docs/security.md)"
            )
        return v


class VerifyingConnection(RunConnection):
    """A service that checks the learner's announcements (the broker, the generators)."""

    announce_public_key_file: str = Field(
        "",
        description="file holding the run's public announcement key (64 hex digits; relay up writes "
        "runs/<id>/secrets/announce.pub); needed by announce_auth = ed25519",
    )


class ConfigError(Exception):
    """A config that cannot be used; the message names the field and what would be valid."""


def _parse_value(raw: str) -> Any:
    """A value from the command line or the environment: JSON when it parses, else the string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _set_nested(d: dict, path: list[str], value: Any, copy: bool = False) -> None:
    """``d[path[0]]...[path[-1]] = value``, making the sections on the way (``copy``: copying those that exist,
    which may be shared with a caller's dict). A section chosen by its type may be given as the type alone, before
    or after its fields (``--set weights.transport=collective --set weights.transport.timeout_s=10``): a string
    on the way is spelled out (``{"type": ...}``), and a string set over a section sets its type."""
    for p in path[:-1]:
        if copy and isinstance(d.get(p), dict):
            d[p] = dict(d[p])
        if isinstance(d.get(p), str):
            d[p] = {"type": d[p]}
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {p} is not a section")
    if isinstance(value, str) and isinstance(d.get(path[-1]), dict):
        d[path[-1]] = {**d[path[-1]], "type": value}
    else:
        d[path[-1]] = value


def read_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    text = p.read_text()
    try:
        return tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from None


def set_overrides(pairs: list[str]) -> dict:
    """Nested dict of ``--set field.sub=value`` overrides (the value parsed as by the environment)."""
    out: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set expects field=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        _set_nested(out, key.split("."), _parse_value(raw))
    return out


def env_overrides(model: type[BaseModel], prefix: str = "RELAY_", environ: dict | None = None) -> dict:
    """Nested dict of overrides from ``RELAY_<FIELD>[__<SUBFIELD>...]`` variables that name a field."""
    environ = os.environ if environ is None else environ
    out: dict = {}
    fields = set(model.model_fields) | {old.split(".")[0] for old in getattr(model, "__renamed__", {})}
    for key, raw in sorted(environ.items()):  # a section (RELAY_WEIGHTS__TRANSPORT) before its fields
        if not key.startswith(prefix):
            continue
        path = key[len(prefix) :].lower().split("__")
        if path[0] in fields:
            _set_nested(out, path, _parse_value(raw))
    return out


def switch_types(model: type[BaseModel], base: dict, layer: dict) -> dict:
    """``base`` with each section chosen by its type that ``layer`` gives another type (``--backend vllm`` over a
    file's ``type = "torch"``, ``weights.transport=store`` over ``type = "http"``) emptied, so that merging
    ``layer`` replaces it: the other type's fields (a torch ``threads``, an http ``cache_dir``) do not apply to
    the new one. Both in today's spelling (:func:`migrate`)."""
    out = base
    for name, field in model.model_fields.items():
        below, above = base.get(name), layer.get(name)
        if not (isinstance(below, dict) and isinstance(above, dict)):
            continue
        key = field.discriminator
        if isinstance(key, str) and key in below and key in above and below[key] != above[key]:
            out = {**out, name: {}}
            continue
        for section in _section_models(field.annotation):
            inner = switch_types(section, below, above)
            if inner is not below:
                out = {**out, name: inner}
                break
    return out


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(root)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; docs/config.md lists every field)"
        # the value, when it is one value: never a whole section or config (a model validator's input)
        shown = err["type"] not in ("missing", "extra_forbidden") and not isinstance(err["input"], (dict, list))
        lines.append(f"  {loc}: {msg}" + (f" (got {err['input']!r:.80})" if shown else ""))
    return "invalid config:\n" + "\n".join(lines)


def load_config(
    model: type[T],
    path: str | Path | None = None,
    overrides: dict | None = None,
    environ: dict | None = None,
    pick: Callable[[dict], dict] | None = None,
) -> T:
    """defaults < the file at ``path`` (``pick`` may select the part of it that is this model's) <
    ``RELAY_*`` variables < ``overrides``."""
    try:
        data: dict = read_file(path) if path else {}
        if pick is not None:
            data = pick(data)
        data = migrate(model, data)  # each layer on its own: a later layer's old name overrides a new one below
        for layer in (env_overrides(model, environ=environ), overrides or {}):
            layer = migrate(model, layer)
            data = deep_merge(switch_types(model, data, layer), layer)
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    except ValueError as e:  # migrate's: a renamed key given in both spellings in one layer
        raise ConfigError(f"invalid config: {e}") from None


# the weights section moved to broker/protocol/weights_config.py (imported lazily: it imports this module)
_MOVED = {
    "WeightsConfig": "WeightsConfig",
    "HttpWeightsConfig": "HttpTransport",
    "CollectiveWeightsConfig": "CollectiveTransport",
    "IN_PROCESS_TRANSPORTS": "IN_PROCESS_TRANSPORTS",
}


def __getattr__(name: str) -> Any:
    """The weights section's old import path (``from broker.runtime.config import WeightsConfig``) still works."""
    if name in _MOVED:
        from broker.protocol import weights_config

        return getattr(weights_config, _MOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
