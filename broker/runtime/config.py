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


def migrate(model: type[BaseModel], data: Any) -> Any:
    """``data`` for ``model`` with the renamed keys of the model and of its sections moved (``move_renamed``):
    each layer of a config (file, variables, ``--set``) is migrated on its own before they are merged, so that
    a ``--set`` of the old name overrides a file's new one instead of clashing with it."""
    data = move_renamed(data, getattr(model, "__renamed__", {}), model.__name__)
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, field in model.model_fields.items():
        if isinstance(out.get(name), dict):
            for section in _section_models(field.annotation):
                out[name] = migrate(section, out[name])
    return out


def renamed_path(model: type[BaseModel], path: list[str]) -> list[str]:
    """``path`` (a field's segments) in its new spelling when it starts with one of ``model``'s renamed keys."""
    for old, new in getattr(model, "__renamed__", {}).items():
        old_path = old.split(".")
        if path[: len(old_path)] == old_path:
            return new.split(".") + path[len(old_path) :]
    return path


class StrictModel(BaseModel):
    """Base for every config model: unknown fields are rejected, assignments validated, and NaN and
    ±inf refused in every float field (no field of Relay's config has a meaning for them: an unbounded
    value is spelled ``null`` where a field allows it, e.g. ``learner.correction.tis_cap``).

    A model whose fields moved lists them in ``__renamed__`` (old dotted path -> new one): the old keys
    keep working, with a warning (:func:`move_renamed`; docs/config.md, "Renamed keys")."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    __renamed__: typing.ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        return move_renamed(data, cls.__renamed__, cls.__name__)


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


class HttpWeightsConfig(StrictModel):
    """``weights.transport = "http"``: the learner serves the weight store over HTTP (docs/weights.md)."""

    host: str = Field("127.0.0.1", description="address the learner's weight server binds")
    port: int = Field(0, ge=0, le=65535, description="its port (0 = any free port; the URL is announced)")
    advertise_url: str = Field(
        "",
        description="base URL the generators fetch from (default: http://host:port; "
        "set it when the generators reach the learner under another name). A generator "
        "fetches only from this URL (or http://host:port with a fixed port), whatever URL an "
        "announcement names; relay up sets it",
    )
    cache_dir: str = Field(
        "", description="generators: folder the fetched versions are kept in (default: a private temporary folder)"
    )
    linger_s: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="learner: at the end of the run, keep serving until "
        "every live generator serves the last version, at most this long",
    )

    def base_url(self) -> str:
        """The learner's weight server as configured: ``advertise_url``, else ``http://host:port`` when the
        port is fixed; "" when the port is only chosen when the server starts (0)."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        if not self.port:
            return ""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"


class CollectiveWeightsConfig(StrictModel):
    """``weights.transport = "collective"``: versions broadcast over torch.distributed (docs/weights.md)."""

    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="process-group backend: auto = nccl on GPUs, gloo on CPU"
    )
    host: str = Field(
        "127.0.0.1",
        description="address the learner's rendezvous binds (that address only); joins "
        "prove the run's weights key (weights.auth)",
    )
    port: int = Field(0, ge=0, le=65535, description="its port (0 = any free port; the address is advertised in Redis)")
    max_members: int = Field(
        256,
        ge=1,
        le=4096,
        description="generators the learner broadcasts to at most; a join "
        "beyond is refused (each member is a gloo group with its own threads)",
    )
    bucket_mb: float = Field(64.0, gt=0, description="tensors are broadcast in buckets of about this many MiB")
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="a broadcast (or a join) that takes longer drops the "
        "generator from the group; it catches up from the store and joins again",
    )


# the transports that hand each version to the generators' engines in process (learner/broadcast.py,
# learner/ipc.py): whole models, received by a generator thread, with the store copy written behind
IN_PROCESS_TRANSPORTS = ("collective", "ipc")


class WeightsConfig(StrictModel):
    """How versions travel from the learner to the generators: one section that ``relay up`` gives to both
    (``--set weights.transport=http``); a service on its own takes it as ``weights.*`` (docs/weights.md)."""

    transport: Literal["store", "http", "collective", "ipc"] = Field(
        "store",
        description="store: immutable folders on a shared volume; http: the learner serves them, no "
        "shared volume; collective: broadcast straight into the generators' engines (store copy written behind); "
        "ipc: generators on the learner's host copy each version from its shared memory (CUDA IPC on a GPU; "
        "store copy written behind)",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="dtype of the published weights: auto = the training dtype (bf16 when "
        "learner.deepspeed.bf16), else as given",
    )
    shard_mb: float = Field(
        512.0,
        gt=0,
        description="safetensors shard size in MiB (several shards: the Hugging "
        "Face index is written too; shards are what lets hash_threads hash one version on "
        "several cores)",
    )
    hash_threads: int = Field(
        8,
        ge=1,
        le=64,
        description="shards written and hashed side by side by the learner, "
        "and read and verified side by side by each generator (one file's sha256 is "
        "sequential: ~1.5 GB/s per core)",
    )
    digest: Literal["xxh3", "sha256"] = Field(
        "xxh3",
        description="per-tensor hash of the tensor digest every generator checks against what it applied: "
        "xxh3 (XXH3-128, ~5x faster) or sha256 (cryptographic; the files' own hashes are sha256 either way)",
    )
    auth: Literal["key", "insecure"] = Field(
        "key",
        description="key: the learner's weight listeners (the http server, the collective rendezvous) admit "
        "only holders of the run's weights key (key_file): the learner and the generators; insecure: whoever reaches "
        "the port receives the weights (docs/security.md)",
    )
    key_file: str = Field(
        "",
        description="file holding the run's weights key (64 hex digits, mode 0600; relay up "
        "writes runs/<id>/secrets/weights.key); read by the learner and the generators with the "
        "http and collective transports",
    )
    http: HttpWeightsConfig = Field(default_factory=HttpWeightsConfig, description="the http transport")
    collective: CollectiveWeightsConfig = Field(
        default_factory=CollectiveWeightsConfig, description="the collective transport"
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
    which may be shared with a caller's dict)."""
    for p in path[:-1]:
        if copy and isinstance(d.get(p), dict):
            d[p] = dict(d[p])
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {p} is not a section")
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
    for key, raw in environ.items():
        if not key.startswith(prefix):
            continue
        path = key[len(prefix) :].lower().split("__")
        if path[0] in fields:
            _set_nested(out, path, _parse_value(raw))
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
        data = deep_merge(data, migrate(model, env_overrides(model, environ=environ)))
        data = deep_merge(data, migrate(model, overrides or {}))
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    except ValueError as e:  # migrate's: a renamed key given in both spellings in one layer
        raise ConfigError(f"invalid config: {e}") from None
