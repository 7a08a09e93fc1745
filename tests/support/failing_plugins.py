"""A reward plugin that raises on every batch, installed for a test's child processes the way a user
installs one: a package with a ``relay.rewards`` entry point (a ``*.dist-info`` folder on the path).

``install(folder)`` writes that folder and returns the ``PYTHONPATH`` entry that makes every child
process (``relay up``'s reward service) find it; the plugin is then named ``raises`` in
``reward.task_plugins``."""

from __future__ import annotations

from pathlib import Path

from reward_service.plugins import RewardPlugin

MESSAGE = "the test plugin's own bug"


class Raises(RewardPlugin):
    """Fails every batch with ``ValueError(MESSAGE)``: the service marks each item ``plugin_error``."""

    async def score(self, items):
        raise ValueError(MESSAGE)


def install(folder: Path, name: str = "raises") -> str:
    """Register :class:`Raises` as ``name`` through an entry point in ``folder``; returns the folder, for
    ``PYTHONPATH``."""
    dist = folder / "relay_test_plugins-0.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: relay-test-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[relay.rewards]\n{name} = tests.support.failing_plugins:Raises\n")
    return str(folder)
