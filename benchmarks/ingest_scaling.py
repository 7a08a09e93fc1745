"""ingest_scaling: groups/s with 1, 2, 4 and 8 producer processes through a broker with 1 and with 2
ingest workers (``broker.ingest_workers``), against the same producers writing the same payloads
straight into a Redis stream (benchmarks/ingest.py: pipelined XADD, the same consumer), in one run.

Every round carries the same number of groups, split over its producers; for each producer count the
three paths (raw, 1 worker, 2 workers) alternate round by round, so they share the machine's load.
One row per (producers, workers): the median round against the raw median with as many producers.
docs/benchmarks.md says where it saturates and what would carry it past one Redis.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from benchmarks.common import Stack, row
from benchmarks.ingest import RAW_STREAM, Round, median_cpu, one_round, start_broker

PRODUCERS = (1, 2, 4, 8)
WORKERS = (1, 2)


def run(quick: bool) -> list[dict]:
    import redis

    from broker.client.telemetry import read_stats
    from broker.protocol.keys import Keys

    producers, per_round, tokens, rounds = ((1, 4), 80, 128, 1) if quick else (PRODUCERS, 800, 1024, 3)
    with tempfile.TemporaryDirectory(prefix="relay-bench-ingest-scaling-") as tmp, Stack(Path(tmp)) as stack:
        url = stack.redis()
        r = redis.Redis.from_url(url)
        brokers = {w: (f"bench-w{w}", *start_broker(stack, r, f"bench-w{w}", w)) for w in WORKERS}
        r.xgroup_create(RAW_STREAM, "learner", id="0", mkstream=True)
        got: dict[tuple[int, int], list[Round]] = {}  # (producers, workers; 0 = raw) -> its rounds
        seed = 0
        for p in producers:
            each = per_round // p
            for _ in range(rounds):
                seed += 100
                got.setdefault((p, 0), []).append(one_round("raw", url, r, RAW_STREAM, each, tokens, seed, producers=p))
                for w, (run_id, address, keys, pid) in brokers.items():
                    seed += 100
                    got.setdefault((p, w), []).append(
                        one_round(
                            "broker",
                            address,
                            r,
                            Keys(run_id).trajectories,
                            each,
                            tokens,
                            seed,
                            keys,
                            producers=p,
                            run_id=run_id,
                            broker_pid=pid,
                        )
                    )
        for w, (run_id, *_) in brokers.items():
            sent = sum(rounds * (per_round // p * p) for p in producers)
            accepted = int(read_stats(r, Keys(run_id), "broker").get("accepted", 0))
            if accepted != sent:
                raise RuntimeError(f"the broker with {w} worker(s) accepted {accepted} groups, expected {sent}")
    rows = []
    rate = {k: statistics.median(x.groups_per_s for x in v) for k, v in got.items()}
    for p in producers:
        for w in WORKERS:
            rows.append(
                row(
                    f"ingest_scaling/{p}p/{w}w",
                    rate[(p, w)],
                    rate[(p, 0)],
                    "groups/s",
                    None,
                    "higher",
                    {
                        "producers": p,
                        "workers": w,
                        "rounds_groups_per_s": [x.groups_per_s for x in got[(p, w)]],
                        "raw_rounds_groups_per_s": [x.groups_per_s for x in got[(p, 0)]],
                        "groups_per_round": per_round // p * p,
                        "tokens_per_sample": tokens,
                        "samples": 8,
                        "over_one_worker": rate[(p, w)] / rate[(p, 1)],
                        # CPU µs per group by party (the broker: all its workers), median rounds
                        "cpu_us_per_group": median_cpu(got[(p, w)]),
                        "raw_cpu_us_per_group": median_cpu(got[(p, 0)]),
                    },
                )
            )
    return rows
