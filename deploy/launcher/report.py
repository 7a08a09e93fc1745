"""The end-of-run report: a few lines from ``summary.json`` (``relay up`` prints it at the end,
``relay status RUN`` prints it for a finished run). What went wrong on the way has lines of its own
when it happened: reward failures by plugin with their reason, groups dropped by reason, restarts
with each service's last error, the warnings printed during the run. The error, when there is one,
comes last."""

from __future__ import annotations

import sys
from pathlib import Path


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _num(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _path(p: Path | str) -> str:
    """A path as short as it can be typed from here."""
    try:
        return str(Path(p).relative_to(Path.cwd()))
    except ValueError:
        return str(p)


# the learner's reasons for dropping a group (summary.json's groups_dropped), as the report says them
DROPPED = {
    "reward_failed": "every reward failed",
    "bad_token": "a token outside the vocabulary",
    "sampling_mismatch": "sampled with other settings",
    "nonfinite": "a non-finite number",
}


def _reward_failures(rf: dict) -> list[str]:
    """The report's line on failed rewards: how many samples, by plugin with each one's latest reason."""
    if not rf.get("samples"):
        return []
    reasons = rf.get("last_reason") or {}
    parts = [
        f"{p} {n}" + (f" ({reasons[p]})" if reasons.get(p) else "") for p, n in (rf.get("by_plugin") or {}).items()
    ]
    scored = f" of {rf['samples'] + rf['samples_scored']}" if rf.get("samples_scored") is not None else ""
    fallback = (
        f"; {rf['samples_trained_on_fallback']} trained on the fallback score"
        if rf.get("samples_trained_on_fallback")
        else ""
    )
    return [f"  rewards      {rf['samples']}{scored} samples failed: " + "; ".join(parts) + fallback]


def format_report(s: dict, run_dir: Path) -> str:
    status = s.get("status", "unknown")
    total = s.get("steps_total")
    steps = f"{s.get('steps', 0)}/{total}" if total else f"{s.get('steps', 0)}"
    resumed = f", resumed {s['resumes']}x" if s.get("resumes") else ""
    lines = [f"relay up: run {s.get('run_id')} {status}: {steps} steps in {_duration(s.get('wall_seconds'))}{resumed}"]
    if "reward_first" in s:
        lines.append(
            f"  reward       {_num(s.get('reward_first'))} -> {_num(s.get('reward_last'))}"
            f"   (mean of the first and last 10% of trained groups)"
        )
    rounds = [e for e in s.get("eval") or [] if e.get("pass@1") is not None]
    if rounds:
        a, b = rounds[0], rounds[-1]
        lines.append(
            f"  eval pass@1  {_num(a['pass@1'])} (v{a.get('version')}) -> {_num(b['pass@1'])} "
            f"(v{b.get('version')})   {len(rounds)} round{'s' if len(rounds) > 1 else ''}"
        )
    if "groups_trained" in s:
        au = s.get("audit") or {}
        other = {k: v for k, v in (s.get("groups_dropped") or {}).items() if v and k != "stale"}
        dropped = "".join(f", {v} dropped ({DROPPED.get(k, k)})" for k, v in sorted(other.items()))
        lines.append(
            f"  groups       {s['groups_trained']} trained, {s.get('groups_dropped_stale', 0)} dropped stale"
            f"{dropped}, {s.get('groups_rejected', 0)} rejected; audit: lost {au.get('lost', '-')}, trained "
            f"twice {au.get('trained_twice', '-')}"
        )
        lines += _reward_failures(s.get("reward_failures") or {})
        restarts = {k: v for k, v in (s.get("restarts") or {}).items() if v}
        if restarts:
            errors = s.get("restart_errors") or {}
            lines.append(
                "  restarts     "
                + ", ".join(
                    f"{k} {v}" + (f" (last error: {errors[k]})" if errors.get(k) else "") for k, v in restarts.items()
                )
            )
    for w in s.get("warnings") or []:
        lines.append(f"  warning      {w}")
    refused = s.get("redis_refused")
    if refused:
        lines.append(
            "  redis        refused "
            + "; ".join(f"{e['user']}: {e['reason']} {e['object']} ({e['count']}x)" for e in refused[:3])
            + " (summary.json: redis_refused)"
        )
    exp = s.get("export")
    if exp:
        lines.append(f"  export       {_path(exp['path'])} (version {exp['version']}; loads with transformers)")
    lines.append(f"  summary      {_path(run_dir / 'summary.json')}")
    lines.append(f"  logs         {_path(run_dir / 'logs')}/")
    lines.append(
        f"  metrics      {_path(run_dir / 'learner' / 'metrics.jsonl')}, TensorBoard "
        f"{_path(run_dir / 'learner' / 'tensorboard')}/"
    )
    if s.get("error"):
        lines.append(f"  error        {s['error']}")
    return "\n".join(lines)


def report_run(p: dict, watch, wall_s: float, resume_command: str) -> None:
    """The end of ``relay up`` (deploy/launcher/up.py ``run_up``: plan -> start -> watch -> report): the run's
    ``summary.json`` (with the part before, when it was resumed), this report on the console, then why it
    ended, how to resume it, or its error, last, where it is seen."""
    import json

    from broker.client.telemetry import read_heartbeats, read_stats
    from deploy.launcher.summary import (
        audit,
        build_summary,
        eval_records,
        export_final,
        outcome,
        read_metrics,
        redis_refusals,
    )
    from deploy.launcher.watch import point_latest

    r, keys, run_dir, rc = watch.r, watch.keys, p["run_dir"], watch.rc
    resumed = p.get("resumed")  # the summary of the part before, when resuming
    # a warning the learner raised at its last steps, after the loop's last look (a short run)
    watch.truncation.check(read_stats(r, keys, "learner"), watch.alerts.policy.suspect())
    published = int(v) if (v := r.hget(keys.stats("learner"), "version")) is not None else None
    if not watch.started and published is not None:
        watch.started = point_latest(p["runs_dir"], run_dir)
    wall = wall_s + ((resumed or {}).get("wall_seconds") or 0)  # both parts of a resumed run
    summary = {
        **outcome(rc, watch.error),
        **build_summary(
            p["run_id"],
            read_metrics(run_dir / "learner" / "metrics.jsonl"),
            published,
            read_stats(r, keys, "broker"),
            read_heartbeats(r, keys),
            wall,
            read_stats(r, keys, "learner"),
        ),
    }
    summary["steps_total"] = watch.total
    summary["resumes"] = resumed.get("resumes", 0) + 1 if resumed is not None else 0
    summary["audit"] = audit(r, keys)
    summary["redis_refused"] = redis_refusals(r)  # a right a service lacks (or someone tried): never silent
    summary["eval"] = eval_records(r, keys, run_dir)  # evaluation rounds (docs/eval.md)
    # the final version as an HF folder, after Ctrl-C too (not after a failure: it may be broken)
    summary["export"] = export_final(run_dir) if rc in (0, 130) else None
    sup = watch.supervisor
    before = (resumed or {}).get("restarts") or {}
    summary["restarts"] = {k: v + before.get(k, 0) for k, v in sup.restarts.items()}  # every part
    hung = (resumed or {}).get("hangs") or {}
    summary["hangs"] = {k: v + hung.get(k, 0) for k, v in sup.hangs.items() if v or hung.get(k)}
    summary["restart_errors"] = {**((resumed or {}).get("restart_errors") or {}), **sup.errors}
    summary["warnings"] = [*((resumed or {}).get("warnings") or []), *watch.alerts.warnings]
    ended = r.get(keys.done)  # the learner's sentence: its steps done, or the dataset ran out
    summary["ended"] = ended.decode() + watch.cut_short if ended and rc == 0 else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(format_report(summary, run_dir), flush=True)
    if summary["ended"]:
        print(f"relay up: the run ended: {summary['ended']}", flush=True)
    if rc == 130:
        print(f"relay up: resume with: {resume_command}", flush=True)
    if watch.error and watch.failure is None:  # a service's failure is printed after the services stop
        print(f"relay up: error: {watch.error}", file=sys.stderr, flush=True)  # last, where it is seen
