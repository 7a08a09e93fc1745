"""The reward service's config (no torch, no FastAPI import).

    [reward]
    task_plugins = { copy = "digits", math = { math = 1.0, overlong = 1.0 } }

    [reward.plugins.math]
    type = "math_verify"

    [reward.plugins.overlong]
    type = "length_penalty"
    options = { max_length = 512, cache = 128 }

A route (a ``task_plugins`` value) is one plugin name, or a table ``{name = weight, ...}`` whose
weighted sum is the score. A name is a configured instance (``plugins``) or a plugin type used
with its default options. See docs/rewards.md.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from broker.runtime.binds import ALLOW_DESCRIPTION, refuse_open_bind
from broker.runtime.config import StrictModel, format_validation_error


class PluginConfig(StrictModel):
    """One named plugin instance."""

    type: str = Field(
        description="plugin type: a built-in (exact_match, digits, regex, length_penalty, "
        "math_verify, code_exec, judge, remote) or a `relay.rewards` entry point"
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the plugin's options, checked against its Options model (docs/rewards.md lists them)",
    )
    cache: bool = Field(
        True,
        description="cache this plugin's ok scores by content hash (when cache_size > 0); "
        "turn off for plugins whose score may change for the same input",
    )


Route = str | dict[str, float]


class RewardConfig(StrictModel):
    """The reward service: where it listens, which plugins exist and which one scores which task."""

    host: str = Field("127.0.0.1", description="bind address; 127.0.0.1 unless you need remote callers")
    port: int = Field(8090, ge=0, le=65535, description="HTTP port")
    plugins: dict[str, PluginConfig] = Field(
        default_factory=dict,
        description="named plugin instances with their options; a plugin type can also be "
        "used by its own name with default options",
    )
    task_plugins: dict[str, Route] = Field(
        default_factory=lambda: {"copy": "digits", "reverse": "digits", "add": "digits"},
        description="task (or route_field value) -> plugin name, or {plugin name: weight} for a weighted sum; "
        "a key not listed uses the plugin of the same name",
    )
    route_field: str = Field(
        "",
        description="when set, an item whose metadata has this field is routed by its "
        "value instead of by its task (per-dataset-row reward choice)",
    )
    max_batch: int = Field(4096, ge=1, description="largest accepted batch (items per request)")
    max_request_bytes: int = Field(32 * 2**20, ge=1024, description="largest accepted request body (bytes)")
    auth_token: str = Field(
        "",
        description="when set, POST /score requires `Authorization: Bearer <token>` "
        "(set it through RELAY_AUTH_TOKEN rather than a file; relay up makes one per run)",
    )
    cache_size: int = Field(0, ge=0, description="scores kept in the content-hash cache (0 = no cache)")
    allow_unauthenticated_bind: bool = Field(
        False, description=ALLOW_DESCRIPTION + ": here, a host that is not loopback without auth_token"
    )

    @model_validator(mode="after")
    def _no_open_bind_without_token(self) -> "RewardConfig":
        if not self.auth_token:
            refuse_open_bind(
                "host",
                self.host,
                self.host,
                "no auth_token is set, so anyone who reaches it can score (and read what plugins answer)",
                "set auth_token (RELAY_AUTH_TOKEN; relay up "
                "makes one per run, relay secrets for compose and Kubernetes)",
                self.allow_unauthenticated_bind,
            )
        return self

    @field_validator("task_plugins")
    @classmethod
    def _weights(cls, v: dict[str, Route]) -> dict[str, Route]:
        for key, route in v.items():
            if isinstance(route, dict):
                if not route:
                    raise ValueError(f"route {key!r}: an empty table; give {{plugin = weight, ...}}")
                bad = [n for n, w in route.items() if not math.isfinite(w)]
                if bad:
                    raise ValueError(f"route {key!r}: weights must be finite numbers ({bad})")
        return v

    @model_validator(mode="after")
    def _plugins_resolve(self) -> "RewardConfig":
        from reward_service.plugins import known_plugins

        known = known_plugins()
        for name, pc in self.plugins.items():
            if pc.type not in known:
                raise ValueError(
                    f"plugins.{name}.type {pc.type!r} is not a plugin type; known: {', '.join(sorted(known))}"
                )
            try:
                known[pc.type].Options.model_validate(pc.options)
            except ValidationError as e:
                raise ValueError(f"plugins.{name}.options: {format_validation_error(e)}") from None
        for key, route in self.task_plugins.items():
            for name in [route] if isinstance(route, str) else route:
                if name in self.plugins:
                    continue
                if name not in known:
                    raise ValueError(
                        f"task_plugins.{key}: {name!r} is neither a configured plugin "
                        f"({', '.join(sorted(self.plugins)) or 'none'}) nor a plugin type "
                        f"({', '.join(sorted(known))})"
                    )
                try:
                    known[name].Options.model_validate({})
                except ValidationError as e:
                    raise ValueError(
                        f"task_plugins.{key}: plugin type {name!r} needs options; configure it under "
                        f"plugins ({format_validation_error(e)})"
                    ) from None
        return self


def check_secrets(cfg: RewardConfig) -> None:
    """Every secret a configured plugin reads from the environment (``token_env``) is set; raises
    ValueError naming the plugin and the variable. ``relay up`` runs it before anything starts; the
    plugins resolve their tokens with the same code (reward_service/httpcall.py) when they start."""
    from reward_service.httpcall import HttpOptions, resolve_token
    from reward_service.plugins import known_plugins

    known = known_plugins()
    for name, pc in cfg.plugins.items():
        opts = known[pc.type].Options.model_validate(pc.options)
        if isinstance(opts, HttpOptions):
            try:
                resolve_token(opts)
            except ValueError as e:
                raise ValueError(f"reward.plugins.{name}.options: {e}") from None
