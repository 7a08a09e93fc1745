"""The end-of-run report: a few lines from ``summary.json`` (``relay up`` prints it at the end,
``relay status RUN`` prints it for a finished run). The error, when there is one, comes last."""

from __future__ import annotations

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


def format_report(s: dict, run_dir: Path) -> str:
    status = s.get("status", "unknown")
    total = s.get("steps_total")
    steps = f"{s.get('steps', 0)}/{total}" if total else f"{s.get('steps', 0)}"
    resumed = f", resumed {s['resumes']}x" if s.get("resumes") else ""
    lines = [f"relay up: run {s.get('run_id')} {status}: {steps} steps in {_duration(s.get('wall_seconds'))}{resumed}"]
    if "reward_first" in s:
        lines.append(f"  reward       {_num(s.get('reward_first'))} -> {_num(s.get('reward_last'))}"
                     f"   (mean of the first and last 10% of trained groups)")
    rounds = [e for e in s.get("eval") or [] if e.get("pass@1") is not None]
    if rounds:
        a, b = rounds[0], rounds[-1]
        lines.append(f"  eval pass@1  {_num(a['pass@1'])} (v{a.get('version')}) -> {_num(b['pass@1'])} "
                     f"(v{b.get('version')})   {len(rounds)} round{'s' if len(rounds) > 1 else ''}")
    if "groups_trained" in s:
        au = s.get("audit") or {}
        lines.append(f"  groups       {s['groups_trained']} trained, {s.get('groups_dropped_stale', 0)} dropped stale, "
                     f"{s.get('groups_rejected', 0)} rejected; audit: lost {au.get('lost', '-')}, trained twice "
                     f"{au.get('trained_twice', '-')}")
        restarts = {k: v for k, v in (s.get("restarts") or {}).items() if v}
        if restarts:
            lines.append("  restarts     " + ", ".join(f"{k} {v}" for k, v in restarts.items()))
    refused = s.get("redis_refused")
    if refused:
        lines.append("  redis        refused " + "; ".join(f"{e['user']}: {e['reason']} {e['object']} ({e['count']}x)"
                                                     for e in refused[:3]) + " (summary.json: redis_refused)")
    exp = s.get("export")
    if exp:
        lines.append(f"  export       {_path(exp['path'])} (version {exp['version']}; loads with transformers)")
    lines.append(f"  summary      {_path(run_dir / 'summary.json')}")
    lines.append(f"  logs         {_path(run_dir / 'logs')}/")
    lines.append(f"  metrics      {_path(run_dir / 'learner' / 'metrics.jsonl')}, TensorBoard "
                 f"{_path(run_dir / 'learner' / 'tensorboard')}/")
    if s.get("error"):
        lines.append(f"  error        {s['error']}")
    return "\n".join(lines)
