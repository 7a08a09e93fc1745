"""Named plugin classes of one kind, for every kind Relay loads by name: reward plugins
(``relay.rewards``, reward_service/plugins.py) and environments (``relay.envs``,
generators/envs/registry.py).

Built-ins register with the decorator; third-party packages declare an entry point in the kind's
group, loaded once, on the first lookup. A registered class must subclass the kind's base class, a
name is taken once (registering the same class again is harmless), and the class learns its name
(``cls.name``)."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable, Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    def __init__(self, kind: str, base: T, group: str):
        self.kind, self.base, self.group = kind, base, group
        self.classes: dict[str, T] = {}
        self._entry_points_loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        def deco(cls: T) -> T:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{self.kind} {name!r}: {cls!r} is not a subclass of {self.base.__name__}")
            if name in self.classes and self.classes[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} is already registered by {self.classes[name].__qualname__}")
            cls.name = name
            self.classes[name] = cls
            return cls

        return deco

    def load_entry_points(self) -> list[str]:
        """Register the classes of the entry-point group (a package's ``[project.entry-points."<group>"]``)."""
        loaded = []
        for ep in entry_points(group=self.group):
            self.register(ep.name)(ep.load())  # refuses what is not a subclass of the base (TypeError)
            loaded.append(ep.name)
        return loaded

    def known(self) -> dict[str, T]:
        """Every class: the built-ins and (loaded once) the entry-point ones."""
        if not self._entry_points_loaded:
            self.load_entry_points()
            self._entry_points_loaded = True
        return self.classes
