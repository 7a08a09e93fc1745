"""``summary.json``: the machine-readable result of a run (stable keys, see README)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def reward_first_last(metrics: list[dict], frac: float = 0.1) -> tuple[float | None, float | None]:
    """Mean reward of the first and the last ``frac`` of trained groups, in training order."""
    rewards = [r for m in metrics for r in m.get("group_rewards", [])]
    if not rewards:
        return None, None
    k = max(1, int(len(rewards) * frac))
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def build_summary(run_id: str, metrics: list[dict], learner_version: int | None, broker_stats: dict,
                  generators: dict[str, dict], wall_seconds: float) -> dict:
    first, last = reward_first_last(metrics)
    lastm = metrics[-1] if metrics else {}
    return {
        "run_id": run_id,
        "steps": lastm.get("step", 0),
        "versions_published": learner_version or 0,
        "reward_first": first,
        "reward_last": last,
        "groups_trained": lastm.get("groups_trained", 0),
        "groups_dropped_stale": lastm.get("groups_dropped_stale", 0),
        "groups_rejected": int(sum(v for k, v in broker_stats.items() if k.startswith("rejected:"))),
        "generators": {
            gid: {"backend": hb.get("backend"), "version_applied": hb.get("version"),
                  "groups_sent": hb.get("groups_sent", 0)}
            for gid, hb in sorted(generators.items())
        },
        "wall_seconds": round(wall_seconds, 1),
    }
