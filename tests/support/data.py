"""Test data: a valid group with every field set, a sealed weight snapshot."""

from __future__ import annotations

import numpy as np

from broker.client.announcements import announce
from broker.protocol import weightstore as ws
from broker.protocol.group import Group, Sample
from broker.protocol.messages import Announcement

MAKE_GROUP_HASH = "ab" * 32  # make_group's weight_hash


def announce_make_group_versions(r, keys, key: bytes | None) -> None:
    """Announce versions 3 and 4 with make_group's hash, as a learner would have (signed with ``key``, the
    services' private announcement key): the broker then accepts make_group's groups (weight_version 3, tokens of
    versions 3 and 4)."""
    for v in (3, 4):
        announce(r, keys, Announcement(version=v, hash=MAKE_GROUP_HASH, path=f"/weights/v{v}"), key)


def make_group(**kw) -> Group:
    samples = [
        Sample(np.array([5, 6, 2], np.int32), np.array([-0.5, -1.0, -0.1], np.float32), [[3, 2], [4, 1]], "stop", 1.0),
        Sample(
            np.array([7], np.int32),
            np.array([-2.0], np.float32),
            [[4, 1]],
            "length",
            None,
            "failed",
            {"reason": "timeout"},
        ),
    ]
    fields = dict(
        group_id="g1",
        run_id="r",
        prompt_id="p1",
        prompt_ids=np.array([1, 4, 14], np.int32),
        samples=samples,
        generator_id="gen-0",
        weight_version=3,
        weight_hash=MAKE_GROUP_HASH,
        sampling={"temperature": 1.0, "n": 2},
        task="copy",
        reference="45",
    )
    fields.update(kw)
    return Group(**fields)


def snapshot(root, version, content=b"weights"):
    d = ws.staging_dir(root, version)
    (d / "model.safetensors").write_bytes(content)
    (d / "config.json").write_text("{}")
    return ws.seal(root, version, d)
