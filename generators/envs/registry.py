"""The environment registry: a decorator, the built-ins, and ``relay.envs`` entry points.

    @register_env("my_env")
    class MyEnv(Environment): ...

    factory = build_env("my_env", {"some_option": 3})   # at generator start: options validated here
    env = factory()                                      # one Environment per episode
    factory.stats()                                      # counters the generator reports
    factory.tool_specs()                                 # the OpenAI `tools` list, for the chat template
    factory.close()                                      # at generator stop

Third-party environments register through the ``relay.envs`` entry-point group
(``my_env = "package.module:MyEnv"`` in their ``pyproject.toml``), loaded the first time an
environment is looked up.

What episodes of one environment config share (a thread pool for tools, the remote environment's HTTP
client and circuit breaker, counters) lives in the class's optional ``Shared`` class: the factory
makes one ``Shared(options)`` and hands it to every episode as ``cls(options, shared=...)``. It has
``stats() -> dict`` (JSON values) and ``close()``, and optionally ``tool_specs()`` (the OpenAI ``tools``
list it offers, for chat templates that render tools).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from broker.runtime.registry import Registry
from generators.envs.base import Environment

_ENVS = Registry("environment", Environment, "relay.envs")
REGISTRY: dict[str, type[Environment]] = _ENVS.classes
register_env = _ENVS.register
load_entry_point_envs = _ENVS.load_entry_points  # register third-party environments (``relay.envs``)


class UnknownEnvError(ValueError):
    """No environment by that name; the message lists the valid ones."""


def known_envs() -> dict[str, type[Environment]]:
    """Every environment: the built-ins and (loaded once) the entry-point ones."""
    from generators.envs import calc, remote, tool_env  # noqa: F401  (the built-ins register on import)

    return _ENVS.known()


class EnvFactory:
    """Makes one environment per episode, all with the same validated options and shared state."""

    def __init__(self, cls: type[Environment], options):
        self.cls, self.options = cls, options
        shared_cls = getattr(cls, "Shared", None)
        self.shared = shared_cls(options) if shared_cls is not None else None

    @property
    def name(self) -> str:
        return self.cls.name

    def __call__(self) -> Environment:
        if self.shared is None:
            return self.cls(self.options)
        return self.cls(self.options, shared=self.shared)

    def stats(self) -> dict[str, Any]:
        """The environment's counters (JSON values): requests by outcome, circuit state, tool calls by tool."""
        return self.shared.stats() if self.shared is not None else {}

    def tool_specs(self) -> list[dict[str, Any]]:
        """The OpenAI ``tools`` list the environment offers (for chat templates that render tools); []
        when it offers none or does not say."""
        specs = getattr(self.shared, "tool_specs", None)
        return specs() if specs is not None else []

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()


def _describe(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(options)'}: {err['msg']}" for err in e.errors())


def build_env(name: str, options: dict[str, Any] | None = None) -> EnvFactory:
    """The factory of environment ``name`` with ``options`` validated (ValueError naming the field, or
    UnknownEnvError listing the valid names)."""
    envs = known_envs()
    if name not in envs:
        raise UnknownEnvError(
            f"unknown environment {name!r}; valid: {', '.join(sorted(envs))} (third-party "
            f"environments register through the 'relay.envs' entry-point group)"
        )
    cls = envs[name]
    try:
        opts = cls.Options.model_validate(options or {})
    except ValidationError as e:
        raise ValueError(f"environment {name!r}: invalid options: {_describe(e)}") from None
    return EnvFactory(cls, opts)
