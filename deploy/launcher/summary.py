"""``summary.json``: the machine-readable result of a run (stable keys, see README)."""

from __future__ import annotations

import json
from pathlib import Path

from broker.dashboard.state import episode_totals
from broker.protocol.messages import Heartbeat


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


def outcome(rc: int, error: str | None) -> dict:
    """summary.json's ``status`` (completed, interrupted by Ctrl-C or SIGTERM, failed) and ``error``."""
    status = "completed" if rc == 0 else "interrupted" if rc == 130 else "failed"
    return {"status": status, "error": error if status == "failed" else None}


def dropped_counts(lastm: dict, learner_stats: dict) -> dict[str, int]:
    """``groups_dropped_<why>`` -> groups the learner dropped: its stats in Redis, which count drops as they
    happen (when every group is dropped, no step ever writes a metrics line), else the last metrics line."""
    keys = {k for k in (*lastm, *learner_stats) if k.startswith("groups_dropped_")}
    return {k: int(max(float(learner_stats.get(k, 0) or 0), float(lastm.get(k, 0) or 0))) for k in sorted(keys)}


def build_summary(
    run_id: str,
    metrics: list[dict],
    learner_version: int | None,
    broker_stats: dict,
    generators: dict[str, Heartbeat],
    wall_seconds: float,
    learner_stats: dict | None = None,
) -> dict:
    first, last = reward_first_last(metrics)
    lastm = metrics[-1] if metrics else {}
    dropped = dropped_counts(lastm, learner_stats or {})
    return {
        "run_id": run_id,
        "steps": lastm.get("step", 0),
        "versions_published": learner_version or 0,
        "reward_first": first,
        "reward_last": last,
        "groups_trained": lastm.get("groups_trained", 0),
        "groups_dropped_stale": dropped.get("groups_dropped_stale", 0),
        "groups_dropped_nonfinite": dropped.get("groups_dropped_nonfinite", 0),
        # every reason: stale, reward_failed, bad_token, sampling_mismatch, nonfinite (docs/learner.md)
        "groups_dropped": {k[len("groups_dropped_") :]: v for k, v in dropped.items() if v},
        "skipped_steps": lastm.get("skipped_steps", 0),  # optimizer steps skipped for a NaN/inf loss or gradient
        "groups_rejected": int(sum(v for k, v in broker_stats.items() if k.startswith("rejected:"))),
        "reward_failures": reward_failures({**lastm, **dropped}, generators),
        "episodes": episode_totals([hb.episodes for hb in generators.values()]),  # {} for single-turn tasks
        "generators": {
            gid: {
                "backend": hb.backend,
                "version_applied": hb.version,
                "groups_sent": hb.groups_sent,
                "updates": hb.updates,
                "refused_updates": hb.refused_updates,
                "engine": hb.engine,
            }
            for gid, hb in sorted(generators.items())
        },
        "wall_seconds": round(wall_seconds, 1),
    }


def reward_failures(lastm: dict, generators: dict[str, Heartbeat]) -> dict:
    """What failed rewards did to the run: samples whose reward failed (by plugin, as the generators
    counted them, with each plugin's latest reason), groups the learner dropped because none of their
    rewards was usable, and the samples trained on ``learner.batch.fallback_score`` instead (``fallback_used``:
    the reward figures then include that score, not a measured one)."""
    by_plugin: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for hb in generators.values():
        for plugin, n in hb.reward_failures_by_plugin.items():
            by_plugin[plugin] = by_plugin.get(plugin, 0) + int(n)
        reasons.update(hb.reward_last_failure)
    fallback = int(lastm.get("samples_reward_fallback", 0) or 0)
    return {
        "samples": sum(int(hb.reward_failures) for hb in generators.values()),
        "samples_scored": sum(int(hb.reward_ok) for hb in generators.values()),
        "by_plugin": dict(sorted(by_plugin.items())),
        "last_reason": dict(sorted(reasons.items())),
        "groups_dropped": int(lastm.get("groups_dropped_reward_failed", 0) or 0),
        "samples_trained_on_fallback": fallback,
        "fallback_used": fallback > 0,
    }


def redis_refusals(r) -> list[dict] | None:
    """What the run's Redis refused its users (its ACL LOG: a service denied a right it needs, or someone
    with a service's password trying one it lacks; deploy/launcher/redis_acl.py), as {user, reason,
    command or key, where, count}; None when this Redis has no log to show (an external one)."""
    import redis

    try:
        entries = r.acl_log(count=100)
    except redis.RedisError:
        return None
    return [
        {
            "user": e.get("username"),
            "reason": e.get("reason"),
            "object": e.get("object"),
            "context": e.get("context"),
            "count": e.get("count"),
        }
        for e in entries
    ]


def audit(r, keys) -> dict:
    """Where every group went, from the counters the broker's and the learner's atomic scripts keep in
    Redis (broker/protocol/scripts.py): exact for the whole run, however long (the de-duplication and
    commit records are trimmed to ``record_window`` ids; the counters are not).

    produced: groups appended to the replay queue (the broker's ``accepted``); trained_once: committed
    as trained; trained_twice: commits of a group id already committed (from the kept commit log; the
    commit script refuses them, so it is 0 unless something is wrong); dropped: by the learner, with a
    reason; queued: still in the stream (not yet read, or read and not yet committed); rejected /
    duplicates_ignored: broker counters; lost: produced but none of the above (must be 0).
    """
    from broker.client import queues

    c = queues.audit_counts(r, keys)
    stats = {k.decode(): int(float(v)) for k, v in r.hgetall(keys.stats("broker")).items()}
    return {
        "produced": c["accepted"],
        "trained_once": c["committed"],
        "trained_twice": c["committed_again"],
        "dropped": c["dropped"],
        "queued": c["queued"],
        "rejected": stats.get("rejected_total", 0),
        "duplicates_ignored": stats.get("duplicate", 0),
        "lost": c["accepted"] - c["committed"] - c["dropped"] - c["queued"],
    }


def eval_records(r, keys, run_dir: Path) -> list[dict]:
    """summary.json's ``eval``: the evaluation rounds (broker/prompts/evals.py), also written to
    ``eval.jsonl`` and, as ``eval/*`` scalars, to the run's TensorBoard folder."""
    from broker.prompts.evals import history_for_summary

    rounds = history_for_summary(r, keys)
    if rounds:
        (run_dir / "eval.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rounds))
        try:
            from learner.records import write_eval

            write_eval(run_dir / "learner" / "tensorboard", rounds)
        except ImportError as e:  # tensorboard is a dependency; say so rather than fail the summary
            print(f"relay up: evaluation not written to TensorBoard: {e}")
    return rounds


def export_final(run_dir: Path) -> dict | None:
    """The newest published version as a Hugging Face folder in ``<run>/export`` (summary's ``export``;
    a resumed run replaces the export of its interrupted part). A LoRA adapter version is exported merged
    (the adapter in ``export/adapter``), so the export loads as a model whatever the run trained."""
    from deploy.export import ExportError, export

    try:
        rec = export(run_dir, run_dir / "export", overwrite=True, merged=True)
    except ExportError as e:
        print(f"relay up: no export: {e}")
        return None
    return {"path": rec["path"], "version": rec["version"], "manifest_hash": rec["manifest_hash"]}
