"""ingest: groups/s and MB/s from 2 producer processes through ZeroMQ -> ``relay broker`` (validation,
de-duplication, the queue bound, the Lua append) -> Redis stream -> a consumer reading through the
``learner`` consumer group, against the same 2 processes writing the same payloads straight into a
Redis stream with redis-py pipelined XADD (no broker) and the same consumer. Each broker producer
keeps ``WINDOW`` groups in flight (``GroupSender.send_many``), as the raw one pipelines 64 XADDs.

The producers encode their groups and connect (the broker's: CURVE handshake done with every worker)
before the clock starts; the clock runs from "go" until the consumer has read (XREADGROUP, and for the
broker's stream an MGET of the messages) and acknowledged (XACK + XDEL, and DEL of those messages) the
last group. Rounds alternate between the paths; the figure is the median round. A third path, reported
in ``details`` only (``no_curve_*``), is the same broker without CURVE (``ingest_auth = "insecure"``):
the raw baseline encrypts nothing, and this says how much of the gap is the encryption. ``details`` also has each path's CPU per group by party (the
producers, the broker, Redis, the consumer): on a machine whose cores are all busy, the rates stand in
the inverse ratio of those sums.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import ROOT, Stack, child_env, row, wait_until

TARGET = 0.8
# the baseline: redis-py straight into a stream of its own (raw XADD / XREADGROUP / XACK on purpose:
# it is what the broker and the client library are measured against)
RAW_STREAM = "relay:raw:trajectories"
WINDOW = 64  # groups in flight per broker producer (GroupSender.send_many), = the raw pipeline depth
PLAIN_RUN = "bench-plain"  # the run of the broker without CURVE


def producer(
    mode: str, target: str, count: int, tokens: int, seed: int, keys: list[str], run_id: str = "bench"
) -> None:
    """One producer process: encode ``count`` groups, print "ready", wait for "go" on stdin, send.
    ``target``: a Redis URL (raw), or the broker's ingest address(es), comma-separated."""
    from benchmarks.codec import make_group
    from broker.protocol.group import encode_group

    groups = [make_group(8, tokens, seed * 100_000 + i, run_id) for i in range(count)]
    payloads = [(g.group_id, encode_group(g), str(g.min_version)) for g in groups]
    if mode == "broker":
        from broker.client.sender import GroupSender
        from broker.protocol.ingest_auth import load_client_keys

        # the producer's certificate and the broker's key; none: a broker without CURVE (ingest_auth = "insecure")
        sender = GroupSender(target, curve=load_client_keys(*keys) if keys else None)
        sender.wait_connected()  # connected (the CURVE handshake done) with every worker before the clock runs
    else:
        import redis

        r = redis.Redis.from_url(target)
        r.ping()  # connected before the clock runs, as the broker producer is
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("expected 'go'")
    cpu0 = time.process_time()
    if mode == "broker":
        acks = sender.send_many([(gid, data) for gid, data, _ in payloads], window=WINDOW)
        for gid, ack in acks.items():
            if ack.status != "ok":
                raise SystemExit(f"broker answered {ack.status} {ack.reason} for {gid}")
        sender.close()
    else:
        for i in range(0, len(payloads), 64):
            pipe = r.pipeline(transaction=False)
            for gid, data, v in payloads[i : i + 64]:
                pipe.xadd(RAW_STREAM, {"gid": gid, "data": data, "v": v, "gen": f"raw-{seed}"})
            pipe.execute()
    print(f"cpu {time.process_time() - cpu0}", flush=True)  # this process's CPU seconds from "go" to its last group


def consume(r, stream: str, total: int, timeout_s: float, producers=(), keys=None) -> tuple[int, float]:
    """The benchmark's consumer, raw Redis on purpose (it drains the broker's stream and the raw
    baseline's alike). Read ``total`` entries through the ``learner`` group, acknowledging and deleting
    each batch; returns (bytes read, time.perf_counter() at the last one). The raw baseline's entries hold
    their payloads; the broker's (``keys``: its run's Keys) hold only ids, and their messages are read as
    the learner reads them (one MGET per batch of the ``payload:<stream id>`` keys, deleted with the
    entries: docs/protocol.md 7.3), so the broker's side pays that layout's read. A producer that failed
    (``producers``: their processes) ends the wait at once."""
    got = nbytes = 0
    deadline = time.monotonic() + timeout_s
    while got < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the consumer got {got} of {total} groups from {stream} in {timeout_s}s")
        failed = [p.returncode for p in producers if p.poll() not in (None, 0)]
        if failed:
            raise RuntimeError(f"an ingest producer failed (exit {failed[0]}) after {got} of {total} groups")
        resp = r.xreadgroup("learner", "bench", {stream: ">"}, count=256, block=200)
        for _, entries in resp or []:
            ids = [eid for eid, _ in entries]
            payloads = [f[b"data"] for _, f in entries] if keys is None else r.mget([keys.payload(e) for e in ids])
            if not all(payloads):
                raise RuntimeError(f"{stream}: an entry's message is missing")
            nbytes += sum(map(len, payloads))
            got += len(entries)
            pipe = r.pipeline(transaction=False)
            pipe.xack(stream, "learner", *ids)
            pipe.xdel(stream, *ids)
            if keys is not None:
                pipe.delete(*[keys.payload(e) for e in ids])
            pipe.execute()
    return nbytes, time.perf_counter()


@dataclass
class Round:
    """One round's figures: groups/s, MB/s, and CPU µs per group by party (``redis``: its own account, every
    thread; ``producers``: theirs from "go" to their last group; ``consumer``: this process; ``broker``: the
    broker process and its workers, when its pid was given), each over the clocked part of the round."""

    groups_per_s: float
    mb_per_s: float
    cpu_us: dict[str, float]


def one_round(
    mode: str,
    target: str,
    r,
    stream: str,
    per_producer: int,
    tokens: int,
    seed: int,
    keys: list[str] = (),
    producers: int = 2,
    run_id: str = "bench",
    broker_pid: int | None = None,
) -> Round:
    """One round of ``producers`` processes (``keys``: a broker producer's CURVE key files; ``run_id``: the run
    the broker's groups are for; ``broker_pid``: the broker, whose CPU is then counted)."""
    from broker.protocol.keys import Keys

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.ingest",
                "--run-id",
                run_id,
                "--producer",
                mode,
                target,
                str(per_producer),
                str(tokens),
                str(seed + k),
                *keys,
            ],
            cwd=ROOT,
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for k in range(producers)
    ]
    try:
        for p in procs:
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"ingest producer ({mode}) did not start: {line!r}, exit {p.poll()}")
        redis0, self0 = _redis_cpu_s(r), time.process_time()
        broker0 = _tree_cpu_s(broker_pid) if broker_pid else 0.0
        t0 = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        nbytes, t1 = consume(
            r,
            stream,
            producers * per_producer,
            timeout_s=600,
            producers=procs,
            keys=Keys(run_id) if mode == "broker" else None,
        )
        redis1, self1 = _redis_cpu_s(r), time.process_time()
        broker1 = _tree_cpu_s(broker_pid) if broker_pid else 0.0
        producer_cpu = 0.0
        for p in procs:
            line = p.stdout.readline().split()  # "cpu <seconds>", printed once it has sent its last group
            if line[:1] != ["cpu"]:
                raise RuntimeError(f"ingest producer ({mode}) ended without its CPU line: {line!r}")
            producer_cpu += float(line[1])
            if p.wait(60) != 0:
                raise RuntimeError(f"ingest producer ({mode}) exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    n = producers * per_producer
    cpu = {"producers": producer_cpu, "consumer": self1 - self0, "redis": redis1 - redis0}
    if broker_pid:
        cpu["broker"] = broker1 - broker0
    return Round(n / (t1 - t0), nbytes / (t1 - t0) / 1e6, {k: round(v / n * 1e6, 1) for k, v in cpu.items()})


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) of process ``pid`` and its children so far, from /proc
    (clock ticks: 10 ms; a round of 800 groups resolves ~12 µs per group). A process gone meanwhile
    counts 0: what it spent is not in its parent's account yet."""
    from broker.runtime.procstat import stat_cpu_s

    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except FileNotFoundError:
        children = []
    return (stat_cpu_s(f"/proc/{pid}/stat") or 0.0) + sum(_tree_cpu_s(c) for c in children)


def _redis_cpu_s(r) -> float:
    """The Redis server's CPU seconds so far (user + system, all its threads)."""
    cpu = r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def start_broker(
    stack: Stack, r, run_id: str = "bench", workers: int = 1, auth: str = "curve"
) -> tuple[str, list[str], int]:
    """A ``relay broker`` for run ``run_id`` with ``workers`` ingest workers, ``auth`` its ``ingest_auth``,
    unbounded queue, the versions of benchmarks.codec.make_group's groups announced: (its ingest
    address(es), comma-separated; the producers' CURVE key files, none without CURVE; its pid)."""
    from broker.client.announcements import announce
    from broker.client.connection import worker_addresses
    from broker.protocol.keys import Keys
    from broker.protocol.messages import Announcement
    from deploy.launcher.procs import free_port_run

    ingest = f"tcp://127.0.0.1:{free_port_run(workers)}"
    broker = stack.service(
        f"broker-{run_id}",
        "broker",
        {
            "run_id": run_id,
            "redis_url": stack.redis_url,
            "ingest_bind": ingest,
            "ingest_workers": workers,
            # curve: the stack's keys (Stack.service)
            **({} if auth == "curve" else {"ingest_auth": auth}),
            "http_port": 0,
            "max_queue_groups": 10**9,
            # the consumer acknowledges with raw XACK + XDEL, not the
            # learner's commit that lowers the byte count: no byte bound
            "max_queue_bytes": 1 << 50,
        },
    )
    keys = Keys(run_id)
    wait_until(lambda: r.exists(keys.prompts), 60, "the broker to start", broker)
    for v in (10, 11):  # the versions benchmarks.codec.make_group's groups carry, with their hash
        announce(r, keys, Announcement(version=v, hash="0" * 64, path=f"/bench/v{v}"), stack.announce_key)
    k = stack.ingest_keys()
    return (
        ",".join(worker_addresses(ingest, workers)),
        [k["producer"], k["broker_public_key_file"]] if auth == "curve" else [],
        broker.pid,
    )


def median_cpu(rounds: list[Round]) -> dict[str, float]:
    return {k: round(statistics.median(x.cpu_us[k] for x in rounds), 1) for k in rounds[0].cpu_us}


def run(quick: bool) -> list[dict]:
    import redis

    from broker.client.telemetry import read_stats
    from broker.protocol.keys import Keys

    per_producer, tokens, rounds = (40, 128, 1) if quick else (400, 1024, 5)
    with tempfile.TemporaryDirectory(prefix="relay-bench-ingest-") as tmp, Stack(Path(tmp)) as stack:
        url = stack.redis()
        r = redis.Redis.from_url(url)
        ingest, producer_keys, pid = start_broker(stack, r)
        # the same broker without CURVE (ingest_auth = "insecure"), run by run, to show what the encryption
        # costs: the raw baseline encrypts nothing
        plain_ingest, _, plain_pid = start_broker(stack, r, PLAIN_RUN, auth="insecure")
        keys = Keys("bench")
        r.xgroup_create(RAW_STREAM, "learner", id="0", mkstream=True)
        ours, plain, raw = [], [], []
        for i in range(rounds):
            ours.append(
                one_round(
                    "broker", ingest, r, keys.trajectories, per_producer, tokens, 10 * i, producer_keys, broker_pid=pid
                )
            )
            raw.append(one_round("raw", url, r, RAW_STREAM, per_producer, tokens, 10 * i + 5))
            plain.append(
                one_round(
                    "broker",
                    plain_ingest,
                    r,
                    Keys(PLAIN_RUN).trajectories,
                    per_producer,
                    tokens,
                    10 * i + 7,
                    run_id=PLAIN_RUN,
                    broker_pid=plain_pid,
                )
            )
        for run_id in ("bench", PLAIN_RUN):
            accepted = int(read_stats(r, Keys(run_id), "broker").get("accepted", 0))
            if accepted != 2 * per_producer * rounds:
                raise RuntimeError(
                    f"the broker of {run_id} accepted {accepted} groups, expected {2 * per_producer * rounds}"
                )
    v = statistics.median(x.groups_per_s for x in ours)
    b = statistics.median(x.groups_per_s for x in raw)
    p = statistics.median(x.groups_per_s for x in plain)
    return [
        row(
            "ingest",
            v,
            b,
            "groups/s",
            TARGET,
            "higher",
            {
                "producers": 2,
                "groups_per_round": 2 * per_producer,
                "rounds": rounds,
                "samples": 8,
                "tokens_per_sample": tokens,
                "broker_MB_per_s": statistics.median(x.mb_per_s for x in ours),
                "raw_MB_per_s": statistics.median(x.mb_per_s for x in raw),
                "broker_rounds_groups_per_s": [x.groups_per_s for x in ours],
                "raw_rounds_groups_per_s": [x.groups_per_s for x in raw],
                "raw_pipeline_depth": 64,
                # CPU µs per group by party, median rounds: where each path's CPU goes (docs/benchmarks.md "ingest")
                "broker_cpu_us_per_group": median_cpu(ours),
                "raw_cpu_us_per_group": median_cpu(raw),
                "no_curve_cpu_us_per_group": median_cpu(plain),
                "no_curve_groups_per_s": p,
                "no_curve_ratio": round(p / b, 3),
                "no_curve_rounds_groups_per_s": [x.groups_per_s for x in plain],
                "broker_window": WINDOW,
            },
        )
    ]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="an ingest benchmark producer (started by relay bench ingest)")
    ap.add_argument(
        "--producer",
        nargs="+",
        metavar="MODE TARGET COUNT TOKENS SEED [KEY_FILE BROKER_PUBLIC_KEY_FILE]",
        required=True,
    )
    ap.add_argument("--run-id", default="bench")
    a = ap.parse_args()
    mode, target, count, tokens, seed, *keys = a.producer
    producer(mode, target, int(count), int(tokens), int(seed), keys, a.run_id)
