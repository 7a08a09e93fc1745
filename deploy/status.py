"""``relay status``: the dashboard's state as a table, for people on a remote shell.

``relay status RUN`` (a run folder, or a run id or ``latest`` under ``--runs-dir``) shows a finished
run from its ``summary.json`` (the end-of-run report), or, while it runs, reads its broker at the
port recorded in its ``config/broker.json``. Plain ``relay status`` is ``relay status latest``: the
last run started in ``--runs-dir`` (``runs/latest``); without one there, the broker at
http://127.0.0.1:8080 (a Docker Compose deployment).

Reads ``GET /api/state`` from the broker (``--url``), or builds the same state straight from the
run's Redis (``--redis-url`` + ``--run-id``) when the broker's HTTP port is not reachable.
"""

from __future__ import annotations

import json
import sys


def add_status_arguments(p) -> None:
    p.add_argument(
        "run",
        nargs="?",
        default=None,
        metavar="RUN",
        help="a run folder, or a run id or 'latest' under --runs-dir: a finished run's report from its "
        "summary.json, or the state of a running one (default: latest, when there is one and "
        "neither --url nor --redis-url is given)",
    )
    p.add_argument("--runs-dir", default="runs", help="folder that holds the run folders (default: runs)")
    p.add_argument(
        "--url", default=None, help="the broker's HTTP address (default: the latest run's, else http://127.0.0.1:8080)"
    )
    p.add_argument("--redis-url", default=None, help="read the state from this Redis instead of the broker")
    p.add_argument("--run-id", default=None, help="the run to show (with --redis-url)")
    p.add_argument(
        "--dead-after-s",
        type=float,
        default=10.0,
        help="with --redis-url: a generator is dead after this long without a heartbeat (default 10)",
    )
    p.add_argument("--json", action="store_true", help="print the state as JSON instead of a table")
    p.add_argument(
        "--check", action="store_true", help="exit with code 3 when a generator serves a wrong hash or is dead"
    )


class StatusError(Exception):
    """The state could not be read; the message says from where and why."""


def fetch_state(url: str | None, redis_url: str | None, run_id: str | None, dead_after_s: float = 10.0) -> dict:
    if redis_url:
        import redis

        from broker.client.announcements import announced_runs
        from broker.client.connection import redact_url
        from broker.dashboard.state import build_state
        from broker.protocol.keys import Keys

        r = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=5)
        try:
            if not run_id:
                runs = announced_runs(r)
                raise StatusError(
                    f"--run-id is required with --redis-url; runs in this Redis: {', '.join(runs) or 'none'}"
                )
            st = build_state(r, Keys(run_id), dead_after_s)
        except redis.RedisError as e:
            raise StatusError(f"cannot read Redis at {redact_url(redis_url)}: {e}") from None
        if st["learner_version"] is None and not st["generators"]:
            raise StatusError(
                f"run {run_id!r} has nothing in Redis at {redact_url(redis_url)} (no version, no generator)"
            )
        return st
    import httpx

    base = (url or "http://127.0.0.1:8080").rstrip("/")
    try:
        resp = httpx.get(f"{base}/api/state", timeout=10)
        resp.raise_for_status()
        return resp.json()
    except httpx.HTTPError as e:
        raise StatusError(
            f"cannot read {base}/api/state: {e} (is the broker running? give a RUN folder, --url, "
            f"or --redis-url and --run-id)"
        ) from None


def _f(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if not x.is_integer() else str(int(x))
    return str(x)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip()] + [fmt.format(*r).rstrip() for r in rows]


def format_state(st: dict) -> str:
    ln = st.get("learner") or {}
    rates = st.get("rates") or {}
    f = st.get("failures") or {}
    lh = (st.get("learner_hash") or "")[:12]
    lines = [
        f"run {st['run_id']}   learner version {_f(st['learner_version'])}"
        + (f" ({lh})" if lh else "")
        + f"   step {_f(ln.get('step'))}   reward {_f(ln.get('reward_mean'))}"
        + ("   DONE" if st.get("done") else ""),
        f"queue {st.get('queue_depth')} groups ({st.get('pending_groups')} pending)   prompts ready "
        f"{st.get('prompts_ready')}   groups/s in {_f(rates.get('groups_in_per_s'), 1)} "
        f"out {_f(rates.get('groups_out_per_s'), 1)}",
    ]
    fails = []
    for title, key in (
        ("rejected", "rejected"),
        ("dropped by learner", "learner_dropped"),
        ("reward failures", "reward_failures_by_plugin"),
    ):
        d = {k: v for k, v in (f.get(key) or {}).items() if v}
        if d:
            fails.append(f"{title}: " + ", ".join(f"{k}={v}" for k, v in d.items()))
    if f.get("refused_updates"):
        fails.append(f"refused updates: {f['refused_updates']}")
    lines.append("failures: " + ("; ".join(fails) if fails else "none"))
    lines.append("")
    rows = []
    for g in st.get("generators") or []:
        lat = g.get("last_update_latency_s")
        rows.append(
            [
                g["id"],
                _f(g.get("backend")),
                g.get("state") or "-",
                _f(g.get("version")),
                _f(g.get("lag")),
                (g.get("hash") or "-")[:12],
                "ok" if g.get("hash_ok", True) else f"MISMATCH (announced {(g.get('announced_hash') or '')[:12]})",
                f"{lat * 1000:.0f}" if isinstance(lat, (int, float)) else "-",
                _f(g.get("tokens_per_s"), 1),
                f"{g['age_s']:.1f}s ago" if isinstance(g.get("age_s"), (int, float)) else "-",
                _f(g.get("groups_sent")),
                _f(g.get("refused_updates")),
            ]
        )
    header = [
        "GENERATOR",
        "BACKEND",
        "STATE",
        "VERSION",
        "LAG",
        "HASH",
        "HASH CHECK",
        "APPLY MS",
        "TOK/S",
        "HEARTBEAT",
        "SENT",
        "REFUSED",
    ]
    lines += _table(header, rows) if rows else ["no generator has sent a heartbeat yet"]
    return "\n".join(lines)


def show_run(run: str, runs_dir: str, as_json: bool, dead_after_s: float, check: bool = False) -> int:
    """A run named by its folder: the live state while it runs (its processes in ``pids.json``
    alive), else the report of its ``summary.json``."""
    from pathlib import Path

    from deploy.launcher.report import format_report
    from deploy.launcher.resume import run_folder, still_running

    try:
        folder = run_folder(run, runs_dir)
    except FileNotFoundError as e:
        raise StatusError(str(e)) from None
    if still_running(folder):
        broker = json.loads((folder / "config" / "broker.json").read_text())
        st = fetch_state(f"http://127.0.0.1:{broker.get('http_port', 8080)}", None, None, dead_after_s)
        print(json.dumps(st, indent=1) if as_json else format_state(st))
        return 3 if check and _flagged(st) else 0
    path = folder / "summary.json"
    if not path.is_file():
        from deploy.launcher.resume import relay_command

        raise StatusError(
            f"run {run!r} is not running and has no summary.json: it was killed before it finished "
            f"(`{relay_command()} up --resume {run}` continues it)"
        )
    text = path.read_text()
    summary = json.loads(text)
    print(text if as_json else format_report(summary, Path(folder)))
    return 0 if summary.get("status") in ("completed", "interrupted") else 1


def run_status(args) -> int:
    from pathlib import Path

    try:
        if args.run:
            if args.url or args.redis_url:
                raise StatusError("give a RUN folder, or --url / --redis-url, not both")
            return show_run(args.run, args.runs_dir, args.json, args.dead_after_s, args.check)
        if not (args.url or args.redis_url) and (Path(args.runs_dir) / "latest").exists():
            # the last run started here (runs/latest)
            return show_run("latest", args.runs_dir, args.json, args.dead_after_s, args.check)
        st = fetch_state(args.url, args.redis_url, args.run_id, args.dead_after_s)
    except StatusError as e:
        print(f"relay status: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=1) if args.json else format_state(st))
    return 3 if args.check and _flagged(st) else 0


def _flagged(st: dict) -> bool:
    """A generator serves a wrong hash or is dead (``--check``)."""
    flagged = st.get("flags") or {}
    return bool(flagged.get("hash_mismatch") or flagged.get("dead"))
