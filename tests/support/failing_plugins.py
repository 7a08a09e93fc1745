"""A reward plugin that raises on every batch and an environment that fails every episode at its start,
installed for a test's child processes the way a user installs them: a package with ``relay.rewards``
and ``relay.envs`` entry points (a ``*.dist-info`` folder on the path).

``install(folder)`` writes that folder and returns the ``PYTHONPATH`` entry that makes every child
process (``relay up``'s reward service and generators) find them; the plugin is then named ``raises``
in ``reward.task_plugins``, the environment ``fails_at_start`` in ``generator.episodes.env``."""

from __future__ import annotations

from pathlib import Path

from generators.envs.base import Environment
from reward_service.plugins import RewardPlugin

MESSAGE = "the test plugin's own bug"
ENV_MESSAGE = "the test environment cannot start"


class Raises(RewardPlugin):
    """Fails every batch with ``ValueError(MESSAGE)``: the service marks each item ``plugin_error``."""

    async def score(self, items):
        raise ValueError(MESSAGE)


class FailsAtStart(Environment):
    """Every episode fails as it starts (``reset`` raises, a plugin's bug): the sample is marked failed."""

    def reset(self, prompt) -> None:
        raise ValueError(ENV_MESSAGE)

    def step(self, turn: str):
        raise AssertionError("never reached: reset failed")


def install(folder: Path, name: str = "raises") -> str:
    """Register :class:`Raises` as ``name`` and :class:`FailsAtStart` as ``fails_at_start`` through entry
    points in ``folder``; returns the folder, for ``PYTHONPATH``."""
    dist = folder / "relay_test_plugins-0.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: relay-test-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[relay.rewards]\n{name} = tests.support.failing_plugins:Raises\n\n"
        "[relay.envs]\nfails_at_start = tests.support.failing_plugins:FailsAtStart\n"
    )
    return str(folder)
