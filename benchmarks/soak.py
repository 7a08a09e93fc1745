"""Soak: generators far faster than the learner, for a fixed time; Redis and process memory and
the back-pressure the producers feel, sampled every interval (docs/protocol.md, "Soak").

    .venv/bin/python -m benchmarks.soak --minutes 30 --record-window 1024 --out runs/soak

The learner is slowed on purpose (32 minibatches x 8 epochs: 256 optimizer steps per batch of
32 groups) and admission control is off, so only the broker's queue bound
(`max_queue_groups`, answered `busy`) throttles the generators."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from broker.client import queues
from broker.client.telemetry import read_stats
from broker.protocol.keys import Keys
from deploy.launcher.run_secrets import run_redis_url


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def key_mb(r, key: str) -> float:
    """The memory one key holds (MEMORY USAGE, every element counted)."""
    return (r.memory_usage(key, samples=0) or 0) / 2**20


def key_sizes(r, pattern: str = "*") -> dict[str, float]:
    """Every key's memory in KiB (MEMORY USAGE, every element counted): what the total is made of. The
    queued groups' messages (``...:payload:<stream id>``, one key each) are added up as ``...:payload:*``."""
    out: dict[str, float] = {}
    for k in r.scan_iter(match=pattern, count=1000):
        name = k.decode(errors="replace")
        name = name[: name.index(":payload:") + 9] + "*" if ":payload:" in name else name
        out[name] = out.get(name, 0.0) + (r.memory_usage(k, samples=0) or 0) / 1024
    return {k: round(v, 1) for k, v in out.items()}


def queue_mb(r, keys) -> float:
    """The replay queue's memory: the trajectories stream and its entries' messages."""
    return key_mb(r, keys.trajectories) + sum(
        key_mb(r, k) for k in r.scan_iter(match=keys.payload_prefix + "*", count=1000)
    )


def redis_overheads(r) -> dict[str, float]:
    """Redis's own memory beside the keys (INFO memory, in KiB): clients' buffers, scripts, the
    dataset: what ``used_memory`` holds that no key does."""
    info = r.info("memory")
    names = [
        "used_memory_dataset",
        "used_memory_overhead",
        "used_memory_startup",
        "mem_clients_normal",
        "used_memory_scripts",
        "used_memory_vm_eval",
        "mem_replication_backlog",
        "mem_aof_buffer",
    ]
    return {n: round(info[n] / 1024, 1) for n in names if n in info}


def growth(before: dict[str, float], after: dict[str, float], top: int = 12) -> list[dict]:
    """The keys whose memory changed most between two :func:`key_sizes` (KiB), largest change first."""
    diffs = [
        {"key": k, "early_kib": before.get(k, 0.0), "end_kib": after.get(k, 0.0)} for k in set(before) | set(after)
    ]
    diffs.sort(key=lambda d: -abs(d["end_kib"] - d["early_kib"]))
    return diffs[:top]


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def verdict(rows: list[dict], audit: dict | None, after_s: float = 300.0, span_s: float = 120.0) -> dict:
    """The soak's figures: Redis memory (all of it, and the run's records alone) and every process's RSS,
    as the median over ``span_s`` after the first ``after_s`` against the median over the last ``span_s``
    (the replay stream saws with the learner's checkpoints, so single samples would compare two points
    of the saw), and the run's audit."""
    early = [r for r in rows if after_s <= r["t_s"] < after_s + span_s]
    late = [r for r in rows if r["t_s"] > rows[-1]["t_s"] - span_s]
    out: dict = {"early_window_s": [after_s, after_s + span_s], "late_window_s": [late[0]["t_s"], late[-1]["t_s"]]}
    for col in [c for c in rows[0] if c.endswith("_mb")]:
        a, b = median([r[col] for r in early]), median([r[col] for r in late])
        out[col] = {"early": round(a, 2), "end": round(b, 2), "ratio": round(b / a, 3) if a else None}
    out["audit"] = audit
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    p.add_argument(
        "--record-window",
        type=int,
        default=None,
        help="broker.record_window and learner.batch.record_window (default: theirs, 262,144 group ids)",
    )
    p.add_argument("--out", default="runs/soak")
    a = p.parse_args()
    out = Path(a.out)
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "up",
        "--steps",
        "1000000",
        "--runs-dir",
        str(out),
        "--run-id",
        "soak",
        "--dashboard-port",
        "0",
        "--no-progress",
        "--set",
        "learner.batch.admission_eta=null",
        "--set",
        "learner.optim.minibatches=32",
        "--set",
        "learner.optim.ppo_epochs=8",
        "--set",
        "learner.batch.max_staleness=60",
        "--set",
        "broker.max_queue_groups=256",
        # commits every 10 steps (30 s here): the replay stream's read-but-uncommitted part saws with the
        # checkpoint interval (50 steps: between 0.4 and 1.8 thousand groups), which would hide the rest
        "--set",
        "learner.publish.checkpoint_every=10",
        # every record capped by count, with caps the run reaches within its first 5 minutes, so that
        # what is measured after them is growth with the run's length (defaults: docs/config.md)
        "--set",
        "learner.metrics.history=100",
        "--set",
        "learner.publish.keep_announcements=64",
        "--set",
        "broker.events_kept=200",
    ]
    if a.record_window is not None:
        cmd += [
            "--set",
            f"broker.record_window={a.record_window}",
            "--set",
            f"learner.batch.record_window={a.record_window}",
        ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    run = out / "soak"
    while not (run / "pids.json").is_file():
        time.sleep(0.5)
    pids = json.loads((run / "pids.json").read_text())
    url = run_redis_url(run)  # the launcher's Redis user: reads the run's keys and INFO
    r = redis.Redis.from_url(url)
    keys = Keys("soak")
    records = [keys.seen, keys.seen_prev, keys.trained, keys.trained_prev, keys.trained_log, keys.dropped_log]
    rows, t0 = [], time.monotonic()
    early_keys: dict[str, float] = {}
    early_overheads: dict[str, float] = {}
    end_keys: dict[str, float] = {}
    end_overheads: dict[str, float] = {}
    try:
        while time.monotonic() - t0 < a.minutes * 60:
            time.sleep(a.every)
            if not early_keys and time.monotonic() - t0 >= 300:  # where the verdict's early window begins
                early_keys, early_overheads = key_sizes(r, "relay:soak:*"), redis_overheads(r)
            b, ln = read_stats(r, keys, "broker"), read_stats(r, keys, "learner")
            row = {
                "t_s": round(time.monotonic() - t0),
                "redis_used_mb": round(r.info("memory")["used_memory"] / 2**20, 2),
                "replay_stream_mb": round(queue_mb(r, keys), 2),
                "records_mb": round(sum(key_mb(r, k) for k in records), 3),
                "ids_remembered": sum(int(r.scard(k)) for k in records[:4]),
                "stream_len": queues.queued_groups(r, keys),
                "accepted": int(b.get("accepted", 0)),
                "busy_answers": int(b.get("busy", 0)),
                "trained": int(ln.get("groups_trained", 0)),
                **{f"rss_{n}_mb": round(rss_mb(pid), 1) for n, pid in pids.items()},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        end_keys, end_overheads = key_sizes(r, "relay:soak:*"), redis_overheads(r)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(180)
    summary = run / "summary.json"
    audit = json.loads(summary.read_text()).get("audit") if summary.is_file() else None
    result = {
        "command": cmd,
        "minutes": a.minutes,
        "record_window": a.record_window,
        "rows": rows,
        "verdict": verdict(rows, audit),
        # what changed between the early window and the end: the keys, then Redis's own memory
        "key_growth_kib": growth(early_keys, end_keys),
        "overheads_kib": {"early": early_overheads, "end": end_overheads},
    }
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    print(json.dumps({k: result[k] for k in ("verdict", "key_growth_kib", "overheads_kib")}, indent=1))


if __name__ == "__main__":
    main()
