"""fanout: seconds from the start of a publication until *every* one of N receivers has applied it, for
N = 1, 2, 4 and 8, per weight transport (``store``, ``http``, ``collective``), at ``weight_sync``'s size
(Qwen2.5-0.5B's shape, bf16, ~0.99 GB a version). One row per transport: its figure is the slope of a
line fitted through the four medians (seconds each added receiver adds), against the latency with one
receiver measured in the same run (``ratio``: the share of a one-receiver publication each receiver adds;
no target, it is a measurement for docs/scaling.md). ``details`` also fits the learner process's CPU
seconds per version against N: what serving one more receiver costs the learner (the http weight server's
sends, the collective's per-member broadcast), the part that grows with the fleet wherever the receivers run.

The learner's side is the learner's own (learner/versions.py): the sender ``weights.transport`` names
(learner/transports.py ``build_sender``: the store copy alone, the http weight server, the collective
broadcaster), the Publisher and its BackgroundPublisher thread, fed with ``snapshot`` as a step does.

The receivers are lightweight processes, not generators: 8 engines of 1 GB beside a learner do not fit this
2-core machine. Each runs a generator's own receiving end, :class:`~generators.weights.WeightApplier` with
the transport's ``Receiving`` (generators/transports.py): the store read in place, the http fetcher into a
cache of its own, the collective receiver joined to the broadcast; each checks the manifest's hash and the
tensors' digest as a generator does, and hands the weights to :class:`HoldEngine`, which holds them (copied
into tensors allocated once, as an engine's in-place load; the collective's left in its staging buffer)
and runs no model. Their ``applied`` events carry the time. On one machine they share
its 2 cores with the learner, so with N > 2 the slope includes the receivers' own verifying and copying
queued on those cores: an upper bound of what one more receiver costs where each has a machine of its own
(docs/scaling.md separates the two with the CPU figures in ``details``).

Receivers are added as N grows (1, then 1 more, 2 more, 4 more), each new one first loading the current
version from the store (or over http); then ``WARMUP`` + ``versions`` versions are published one at a time
(the next after the previous is applied on all and its store copy written), medians per N. A count whose
receivers would not fit in the memory available is skipped, and said so in ``details``.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import ROOT, Stack, child_env, row, skipped, wait_until
from benchmarks.weight_sync import WARMUP, Bench

RECEIVERS = (1, 2, 4, 8)
QUICK_RECEIVERS = (1, 2)
TRANSPORTS = ("store", "http", "collective")
UNIT = "s per added receiver (publish -> applied on all)"
POLL_S = 0.02  # a receiver asks for the latest announcement this often (a generator: between batches)
# resident bytes a receiver holds per byte of a version (the held copy, or the collective's staging buffer)
HELD_COPIES = {"store": 1.2, "http": 1.2, "collective": 1.2}
MEMORY_MARGIN = 3 << 30  # bytes left free for the learner's snapshot, page cache and the machine's other work


# -- a receiver (its own process) ------------------------------------------------------------------------------


class HoldEngine:
    """A receiver's engine: no model; it holds the weights of the version applied. A version read from
    files (store, http) is copied from the bytes its check hashed into tensors allocated once (an engine's
    in-place load); one received in process (collective) is held where it landed, in the receiver's staging
    buffer, which the next version then lands in (not adopted as the torch backend's parameters adopt it:
    that keeps a second buffer per receiver, 2 GB, and 8 of them do not fit beside the learner here)."""

    name = "hold"
    supports_in_flight = False
    loads_mapped_files = True  # the WeightApplier hands over what weightstore.check (or the fetcher) hashed

    def __init__(self):
        self.held: dict = {}
        self.eos_token_id = -1

    def load(self, path: str, verified=None) -> None:
        self.update_weights(path, verified=verified)

    def update_weights(self, path: str, files=None, verified=None) -> None:
        from generators.backends.torch import mapped_tensors

        files = verified.files if verified is not None else files
        if not files:
            raise ValueError(f"{path}: nothing verified to hold")
        self.update_weights_from_tensors({k: t for f in files.values() for k, t in mapped_tensors(f).items()})

    def update_weights_from_tensors(self, state: dict, adopt: bool = False) -> bool:
        import torch

        if adopt:  # in process (collective): held in the staging buffer, reused for the next version
            self.held = dict(state)
            return False
        same = set(state) == set(self.held) and all(
            self.held[k].shape == t.shape and self.held[k].dtype == t.dtype for k, t in state.items()
        )
        with torch.no_grad():
            if not same:
                self.held = {k: t.clone() for k, t in state.items()}
            else:
                for k, t in state.items():
                    self.held[k].copy_(t)
        return False


def receive(config_file: str) -> None:
    """A receiver process: the generator config in ``config_file`` (its id, Redis, weight store, ``weights``
    section and keys), a WeightApplier with the transport's receiving end and a :class:`HoldEngine`, asking
    for the latest version every ``POLL_S`` until SIGTERM."""
    from broker.client.connection import connect_redis
    from broker.protocol.keys import Keys
    from broker.protocol.signing import announce_verifier
    from broker.protocol.weightauth import weights_key
    from generators.config import GeneratorConfig
    from generators.transports import ReceiverContext, build_receiving
    from generators.weights import WeightApplier

    cfg = GeneratorConfig.model_validate_json(Path(config_file).read_text())
    key = announce_verifier(cfg.announce_auth, cfg.announce_public_key_file)
    wkey = weights_key(cfg.weights.auth, cfg.weights.key_file, cfg.weights.transport)
    r, keys, engine = connect_redis(cfg.redis_url), Keys(cfg.run_id), HoldEngine()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    receiving = build_receiving(ReceiverContext(cfg, r, keys, engine, key, wkey))
    w = WeightApplier(
        r,
        keys,
        engine,
        cfg.id,
        stopped=stop.is_set,
        announce_key=key,
        store=cfg.weight_store,
        fetcher=receiving.fetcher,
        receiver=receiving.tensors,
        hash_threads=cfg.weights.hash_threads,
    )
    while not stop.is_set():
        w.update(block=True)
        stop.wait(POLL_S)
    if w.receiver is not None:
        w.receiver.close()


# -- the learner's side and the measurement --------------------------------------------------------------------


def fit(xs: list[float], ys: list[float]) -> dict:
    """Least-squares line through (xs, ys): slope, intercept and r²."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss = sum((y - my) ** 2 for y in ys)
    res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    return {"slope": slope, "intercept": intercept, "r2": 1 - res / ss if ss else 1.0}


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


class Fanout:
    """One transport's learner side (the learner's sender, Publisher and BackgroundPublisher, on the
    benchmark's model) and its receivers, added as the count grows."""

    def __init__(self, b: Bench, transport: str):
        import torch

        from broker.protocol.keys import Keys
        from learner.config import LearnerConfig
        from learner.publish import BackgroundPublisher, Publisher
        from learner.transports import SenderContext, build_sender

        self.b, self.transport, self.keys = b, transport, Keys(f"fanout-{transport}")
        extra = {"bucket_mb": 1 / 16} if transport == "collective" and b.quick else {}
        weights = {"transport": {"type": transport, **extra}, "key_file": b.stack.weights_key_file}
        if b.quick:
            weights["shard_mb"] = 0.25  # several shards: the sharded path runs in CI
        self.cfg = cfg = LearnerConfig(
            run_id=self.keys.run_id,
            redis_url=b.redis_url,
            weight_store=str(b.tmp / f"store-{transport}"),
            weights=weights,
        )
        ctx = SenderContext(cfg, b.r, self.keys, b.stack.announce_key, b.stack.weights_key)
        self.sender = build_sender(ctx)
        self.pub = Publisher(
            b.r,
            self.keys,
            cfg.weight_store,
            b.tokenizer,
            cfg.publish.keep_versions,
            b.stack.announce_key,
            torch.bfloat16,
            cfg.weights.shard_mb,
            self.sender.handoff,
            cfg.weights.digest,
            hash_threads=cfg.weights.hash_threads,
        )
        self.bg = BackgroundPublisher(self.pub, b.model.config)
        self.sender.attach(self.pub)
        self.tied = bool(b.model.config.tie_word_embeddings)
        self.receivers: list = []
        self.events_after = "0-0"
        self.applied: dict[int, dict[str, float]] = {}  # version -> receiver -> when it applied it
        self.via: dict[tuple[int, str], str] = {}  # (version, receiver) -> how it arrived

    def receiver_config(self, gid: str) -> dict:
        weights = {"transport": {"type": self.transport}, "key_file": self.b.stack.weights_key_file}
        if self.transport == "http":
            weights["transport"].update(
                advertise_url=self.sender.server.base_url, cache_dir=str(self.b.tmp / f"cache-{gid}")
            )
        if self.cfg.weights.transport.type == "collective":
            weights["transport"]["bucket_mb"] = self.cfg.weights.transport.bucket_mb
        weights["shard_mb"] = self.cfg.weights.shard_mb
        return {
            "id": gid,
            "run_id": self.keys.run_id,
            "redis_url": self.b.redis_url,
            "weight_store": self.cfg.weight_store if self.transport == "store" else "",
            "announce_public_key_file": self.b.stack.announce_public_key_file,
            "weights": weights,
        }

    def publish(self) -> tuple[int, float]:
        """A step's change, its snapshot handed to the publisher thread: (the version, when it started)."""
        from learner.publish import snapshot

        v = self.b.new_weights()
        t0 = time.time()
        sd = self.b.model.state_dict()
        self.bg.submit(v, snapshot(sd, v, self.pub.dtype, self.tied, self.bg.spare(), check=False))
        return v, t0

    def poll(self) -> None:
        from broker.client.telemetry import read_events

        for eid, e in read_events(self.b.r, self.keys, self.events_after, 10_000):
            self.events_after = eid
            if e.kind == "applied":
                self.applied.setdefault(int(e.data["version"]), {})[e.data["generator"]] = e.t
                self.via[int(e.data["version"]), e.data["generator"]] = e.data.get("via")

    def wait_applied(self, version: int, timeout: float = 600) -> dict[str, float]:
        names = {p.name for p in self.receivers}

        def done():
            self.poll()
            return names <= set(self.applied.get(version, {}))

        wait_until(lambda: all(p.alive() or _raise(p) for p in self.receivers) and done(), timeout, f"v{version}")
        return {g: t for g, t in self.applied[version].items() if g in names}

    def grow(self, n: int) -> None:
        """Start receivers until there are ``n``; each applies the latest version before this returns (and,
        collective, has joined the broadcast)."""
        start = len(self.receivers)
        for i in range(start, n):
            gid = f"rcv-{self.transport}-{i}"
            path = self.b.tmp / f"{gid}.json"
            path.write_text(json.dumps(self.receiver_config(gid)))
            cmd = [sys.executable, "-m", "benchmarks.fanout", "--receiver", str(path)]
            self.receivers.append(self.b.stack.procs.start(gid, cmd, env=child_env(), cwd=str(ROOT)))
        self.wait_applied(self.b.next_version)
        if self.transport == "collective":
            want = sorted(p.name for p in self.receivers)
            wait_until(lambda: self.sender.handoff.member_ids() == want, 300, f"{n} receivers to join the broadcast")

    def cpu_s(self) -> list[float]:
        from broker.runtime.procstat import stat_cpu_s

        return [stat_cpu_s(f"/proc/{p.pid}/stat") or 0.0 for p in self.receivers]

    def measure(self, versions: int) -> dict:
        """``WARMUP`` + ``versions`` publications to the receivers there are now, one at a time."""
        lat, learner_cpu, receiver_cpu, spread = [], [], [], []
        for _ in range(WARMUP + versions):
            c0, r0 = time.process_time(), self.cpu_s()
            v, t0 = self.publish()
            applied = self.wait_applied(v)
            vias = {self.via[v, g] for g in applied}
            if vias != {self.transport}:  # the collective's fallback (the store copy) is not what is measured
                raise RuntimeError(f"version {v} arrived via {sorted(vias)}, not {self.transport} alone")
            r1 = self.cpu_s()
            self.bg.drain()  # the store copy written (collective: after the broadcast) before the next version
            lat.append(max(applied.values()) - t0)
            spread.append(sorted(round(t - t0, 4) for t in applied.values()))
            learner_cpu.append(time.process_time() - c0)
            receiver_cpu.append(statistics.fmean(b - a for a, b in zip(r0, r1)))
        m = slice(WARMUP, None)
        return {
            "receivers": len(self.receivers),
            "latency_s": statistics.median(lat[m]),
            "per_version_s": lat[m],
            "warmup_s": lat[:WARMUP],
            "applied_after_s": spread[m],  # each receiver's, sorted
            "learner_cpu_s": statistics.median(learner_cpu[m]),
            "receiver_cpu_s_each": statistics.median(receiver_cpu[m]),
        }

    def close(self) -> None:
        self.b.stack.procs.stop([p.name for p in self.receivers], timeout=10)
        self.bg.close()
        if self.sender.handoff is not None:
            self.sender.handoff.close()
        if getattr(self.sender, "server", None) is not None:
            self.sender.server.close()


def _raise(p) -> bool:
    raise RuntimeError(f"{p.name} exited:\n{p.tail(30)}")


def _bench(b: Bench, transport: str, counts: tuple[int, ...]) -> dict:
    name = f"fanout/{transport}"
    f = Fanout(b, transport)
    points, left_out = [], []
    try:
        v, _ = f.publish()  # the version the first receivers start from
        f.bg.drain()
        nbytes = sum(p.stat().st_size for p in Path(f.bg.last.path).glob("*.safetensors"))
        for n in counts:
            need = (n - len(f.receivers)) * HELD_COPIES[transport] * nbytes + MEMORY_MARGIN
            if _mem_available() < need:
                left_out.append(f"{n} receivers: {need / 2**30:.1f} GiB needed, {_mem_available() / 2**30:.1f} free")
                break
            f.grow(n)
            points.append(f.measure(b.versions))
    finally:
        f.close()
    if len(points) < 2:
        return skipped(name, "; ".join(left_out) or "fewer than 2 receiver counts measured", UNIT, None, "lower")
    xs = [p["receivers"] for p in points]
    latency = fit(xs, [p["latency_s"] for p in points])
    learner = fit(xs, [p["learner_cpu_s"] for p in points])
    return row(
        name,
        latency["slope"],
        points[0]["latency_s"],
        UNIT,
        None,
        "lower",
        {
            **b.details,
            "transport": transport,
            "version_bytes": nbytes,
            "versions": b.versions,
            "points": points,
            "fit": latency,
            "learner_cpu_fit": learner,
            "learner_cpu_s_per_receiver": learner["slope"],
            "per_receiver_MB_per_s": nbytes / latency["slope"] / 1e6 if latency["slope"] > 0 else None,
            "left_out": left_out,
            "receivers": "lightweight: a generator's WeightApplier and receiving end, weights held, no model",
            "cores": "learner and receivers share this machine's cores (benchmarks/fanout.py)",
        },
    )


def run(quick: bool) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="relay-bench-fanout-") as tmp, Stack(Path(tmp)) as stack:
        b = Bench(Path(tmp), stack, quick, versions=2 if quick else 3)
        b.setup()
        return [_bench(b, t, QUICK_RECEIVERS if quick else RECEIVERS) for t in TRANSPORTS]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="a fan-out receiver (started by relay bench fanout)")
    ap.add_argument("--receiver", required=True, metavar="CONFIG_JSON")
    receive(ap.parse_args().receiver)
