"""weight_sync: seconds from the start of a publication (the learner's snapshot of its weights) until 2
running ``relay generator`` processes (torch backend) have applied it, one row per transport
(``weights.transport``), each against a raw baseline measured in the same run on the same bytes:

    store        the publisher thread writes sharded safetensors (hashed while written, shards side by
                 side), seals and announces; each generator verifies every file's sha256 and the tensors'
                 digest in one read of its mapping, then copies the tensors from that mapping into its
                 engine   vs   a plain safetensors save_file + load_file, the loaded tensors copied into
                 tensors allocated once (load_file only maps the file)
    http         generators fetch each version from the learner's weight server (no shared store)
                 vs   a plain HTTP GET of the same bytes per generator
    collective   the tensors broadcast in buckets straight into the generators' engines (gloo here)
                 vs   torch.distributed.broadcast of the same bytes over gloo, among the same processes

and a row for the time the learner was blocked per publication (the snapshot: a CPU copy in the
publication dtype, checked finite) against the store transport's latency (target ≤ 10%), and a ``lora``
row: the same model with rank-16 LoRA adapters, each version the adapter alone (store transport), against
the full-weights ``store`` row (target ≤ 0.25).

The model: a random-init model of Qwen2.5-0.5B's shape (~0.49B parameters, tied embeddings) in bf16,
built locally; with ``--quick`` the 166k-parameter tiny model, published in shards of 0.25 MiB (so that
the sharded path and its index run in CI). Versions and raw copies alternate; each figure is the median
over 5 versions (2 with ``--quick``; the collective, whose rounds take a second, 9 and 3), after one
warm-up version per transport (reported apart as
``warmup_s``: first-touch allocations). Each transport starts its own 2 generators and stops them
before the next (memory: a bf16 0.5B model is ~1 GB per copy).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import Stack, bench_model, row, skipped, wait_until

# latency / raw baseline, at most; lora: an adapter's latency / the same model's full weights (store), at most
TARGETS = {"store": 2.0, "http": 2.0, "collective": 1.5, "lora": 0.25}
BLOCKED_TARGET = 0.10  # learner blocked per publication / store latency, at most
UNIT = "s publish -> applied on 2"
WARMUP = 1  # versions per transport applied before the measured ones (first-touch allocations, page cache)
GENERATORS = ("gen-0", "gen-1")

# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), random init
QWEN05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
)


def build_model(out: Path, quick: bool) -> Path:
    """The benchmark's model folder (config, tokenizer, bf16 safetensors): the tiny model with ``quick``,
    else Qwen2.5-0.5B's shape with the tiny model's tokenizer (the generators only load, never sample)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tiny = bench_model(out.parent / "tiny", quick=True)
    if quick:
        return tiny
    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = Qwen2Config(
        **QWEN05B, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of 2 GB on the way
    try:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@dataclass
class Bench:
    """What every transport's measurement shares: the stack (Redis), the model whose weights change each
    version, and 2 generators started per transport."""

    tmp: Path
    stack: Stack
    quick: bool
    versions: int
    base: Path | None = None  # the model folder (what a generator starts from)
    model: object = None
    tokenizer: object = None
    r: object = None
    keys: object = None
    next_version: int = 0
    details: dict = field(default_factory=dict)
    full_store_s: float | None = None  # the store row's latency: the LoRA row's baseline
    redis_url: str = ""

    def setup(self) -> None:
        import redis
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from broker.client import queues
        from broker.protocol.keys import Keys

        base = self.base = build_model(self.tmp / "base", self.quick)
        self.model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.keys = Keys("bench")
        self.redis_url = self.stack.redis()  # the collective row starts a Redis of its own: not this one
        self.r = redis.Redis.from_url(self.redis_url)
        queues.ensure_groups(self.r, self.keys)  # no prompts: the generators idle
        self.details.update(
            model_params=sum(p.numel() for p in self.model.parameters()),
            dtype="bfloat16",
            tie_word_embeddings=bool(self.model.config.tie_word_embeddings),
        )

    def new_weights(self) -> int:
        """Change the weights (as a step would); the next version's number."""
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1e-3)
        self.next_version += 1
        return self.next_version

    def published_state(self) -> dict:
        """The tensors a publication carries (bf16, without the tied head): the raw baselines' bytes."""
        import torch

        from learner.publish import snapshot

        return snapshot(self.model.state_dict(), 0, torch.bfloat16, bool(self.model.config.tie_word_embeddings))

    def generators(self, weights: dict, store: str) -> list:
        """Start 2 generators (torch backend, bf16) with the ``weights`` section."""
        from deploy.launcher.procs import free_port

        return [
            self.stack.service(
                f"{g}-{weights['transport']['type']}",
                "generator",
                {
                    "id": g,
                    "run_id": "bench",
                    "redis_url": self.redis_url,
                    "weight_store": store,
                    "broker_address": f"tcp://127.0.0.1:{free_port()}",
                    "backend": {"type": "torch", "dtype": "bfloat16"},
                    "heartbeat_s": 0.05,
                    "weights": weights,
                },
            )
            for g in GENERATORS
        ]

    def served(self) -> list:
        from broker.client.telemetry import read_heartbeats

        hb = read_heartbeats(self.r, self.keys)
        return [hb[g].version if g in hb else None for g in GENERATORS]

    def wait_applied(self, version: int, t0: float, procs: list, timeout: float = 600) -> float:
        """Seconds from ``t0`` until both generators applied ``version`` (their ``applied`` events)."""
        from broker.client.telemetry import read_events

        for i, p in enumerate(procs):
            wait_until(lambda: (self.served()[i] or -1) >= version, timeout, f"{p.name} to apply version {version}", p)
        applied = [
            e
            for _, e in read_events(self.r, self.keys, "0-0", 10**6)
            if e.kind == "applied" and e.data["version"] == version
        ]
        return max(e.t for e in applied) - t0

    def event_time(self, kind: str, version: int) -> float:
        """When the first ``kind`` event of ``version`` was emitted."""
        from broker.client.telemetry import read_events

        return min(
            e.t
            for _, e in read_events(self.r, self.keys, "0-0", 10**6)
            if e.kind == kind and e.data.get("version") == version
        )

    def stop(self, procs: list) -> None:
        self.stack.procs.stop([p.name for p in procs], timeout=10)


def _raw_store(state: dict, path: Path, into: dict) -> float:
    """The store's raw baseline: a plain safetensors save_file + load_file of the same tensors, loaded
    into ``into`` (tensors of the same shapes, allocated once: a generator's weights). The copy is part
    of a load: safetensors' load_file maps the file and reads nothing (988 MB "loaded" in ~3 ms), so
    without it the baseline would be the save alone."""
    from safetensors.torch import load_file, save_file

    t0 = time.perf_counter()
    save_file(state, str(path))
    back = load_file(str(path))
    for k, t in back.items():
        into[k].copy_(t)
    dt = time.perf_counter() - t0
    assert len(back) == len(state) == len(into)
    path.unlink()
    return dt


def _bench_store(b: Bench) -> list[dict]:
    """The ``store`` row and the learner's blocked time per publication: the learner's own path (snapshot,
    BackgroundPublisher: write, hash while writing, seal, announce) to 2 generators verifying hash and
    digest and loading in place."""
    import torch

    from broker.protocol import weightstore
    from broker.protocol.weights_config import WeightsConfig
    from learner.publish import BackgroundPublisher, Publisher, snapshot

    shard_mb = 0.25 if b.quick else WeightsConfig().shard_mb
    store = b.tmp / "weights-store"
    pub = Publisher(
        b.r,
        b.keys,
        str(store),
        b.tokenizer,
        keep_versions=3,
        announce_key=b.stack.announce_key,
        dtype=torch.bfloat16,
        shard_mb=shard_mb,
        hash_threads=WeightsConfig().hash_threads,
    )
    tied = bool(b.model.config.tie_word_embeddings)
    bg = BackgroundPublisher(pub, b.model.config)
    v = b.new_weights()
    bg.submit(v, snapshot(b.model.state_dict(), v, torch.bfloat16, tied))
    bg.drain()
    procs = b.generators({"transport": {"type": "store"}, "shard_mb": shard_mb}, str(store))
    try:
        b.wait_applied(v, 0.0, procs)  # the first load (the engine starts)
        ours, raw, blocked, announced = [], [], [], []
        into: dict = {}
        for _ in range(WARMUP + b.versions):
            v = b.new_weights()
            t0 = time.time()
            # the learner waits for the copy; the finiteness check runs in the publisher thread (as in trainer.py)
            state = snapshot(b.model.state_dict(), v, torch.bfloat16, tied, bg.spare(), check=False)
            bg.submit(v, state)
            blocked.append(time.time() - t0)
            del state
            ours.append(b.wait_applied(v, t0, procs))
            announced.append(b.event_time("published", v) - t0)
            state = b.published_state()
            into = into or {k: t.clone() for k, t in state.items()}  # a generator's weights: allocated once
            raw.append(_raw_store(state, b.tmp / "raw.safetensors", into))
            del state
        bg.close()
        warmup = ours[:WARMUP]
        ours, raw, blocked, announced = (x[WARMUP:] for x in (ours, raw, blocked, announced))
    finally:
        b.stop(procs)
    a = bg.last
    files = weightstore.read_manifest(a.path)["files"]
    t1 = time.perf_counter()  # where the time goes, once, in this process
    weightstore.check(a.path, a.hash, expected_digest=a.digest)
    verify_s = time.perf_counter() - t1
    latency = b.full_store_s = statistics.median(ours)
    b.details["full_bytes"] = sum((Path(a.path) / f).stat().st_size for f in files if f.endswith(".safetensors"))
    store_row = row(
        "weight_sync/store",
        latency,
        statistics.median(raw),
        UNIT,
        TARGETS["store"],
        "lower",
        {
            **b.details,
            "versions": b.versions,
            "per_version_s": ours,
            "raw_per_version_s": raw,
            "announced_after_s": announced,
            "safetensors_files": sorted(f for f in files if f.endswith(".safetensors")),
            "safetensors_bytes": sum((Path(a.path) / f).stat().st_size for f in files if f.endswith(".safetensors")),
            "shard_mb": shard_mb,
            "verify_hash_and_digest_s_one_reader": verify_s,
            "warmup_s": warmup,
            "raw": "safetensors save_file + load_file of the same bf16 tensors, copied into tensors allocated once",
        },
    )
    blocked_row = row(
        "weight_sync/learner_blocked",
        statistics.median(blocked),
        latency,
        "s learner blocked per publication",
        BLOCKED_TARGET,
        "lower",
        {
            "per_version_s": blocked,
            "baseline": "the store transport's publish -> applied latency",
            "what": "snapshot: a CPU copy in bf16; the finiteness check and the writing run in the publisher thread",
        },
    )
    return [store_row, blocked_row]


# -- the http transport (weights.transport = "http"; learner/weight_server.py, generators/weight_fetch.py) ----


def _bench_http(b: Bench) -> dict:
    """The ``http`` row: the learner's path (snapshot, BackgroundPublisher into a store that only its weight
    server reads) to 2 generators with ``weights.transport = "http"`` and no weight store, each fetching the
    version over HTTP (hashing while it downloads), checking hash and digest and loading in place; against
    a plain ``save_file`` of the same tensors, then one plain HTTP GET of the file per generator,
    concurrently, from a stdlib ``http.server``, each loaded with ``safetensors.torch.load``."""
    import functools
    import http.server
    import threading
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors.torch import load as load_bytes, save_file

    from broker.protocol.weightauth import bearer_token
    from broker.protocol.weights_config import WeightsConfig
    from learner.publish import BackgroundPublisher, Publisher, snapshot
    from learner.weight_server import WeightServer

    shard_mb = 0.25 if b.quick else WeightsConfig().shard_mb
    store, raw_dir = b.tmp / "weights-http", b.tmp / "http-raw"
    store.mkdir(parents=True, exist_ok=True)
    raw_dir.mkdir(parents=True, exist_ok=True)
    server = WeightServer(store, token=bearer_token(b.stack.weights_key, b.keys.run_id)).start()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(raw_dir)))
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    procs: list = []
    try:
        pub = Publisher(
            b.r,
            b.keys,
            str(store),
            b.tokenizer,
            keep_versions=3,
            announce_key=b.stack.announce_key,
            dtype=torch.bfloat16,
            shard_mb=shard_mb,
            hash_threads=WeightsConfig().hash_threads,
        )
        pub.url_for = server.url
        tied = bool(b.model.config.tie_word_embeddings)
        bg = BackgroundPublisher(pub, b.model.config)
        v = b.new_weights()
        bg.submit(v, snapshot(b.model.state_dict(), v, torch.bfloat16, tied))
        bg.drain()
        procs = b.generators(
            {
                "transport": {"type": "http", "advertise_url": server.base_url},  # fetching from this server only
                "shard_mb": shard_mb,
            },
            "",
        )  # each its own private cache
        b.wait_applied(v, 0.0, procs)  # the first fetch and load (the engine starts)
        ours, raw = [], []
        for _ in range(WARMUP + b.versions):
            v = b.new_weights()
            t0 = time.time()
            bg.submit(v, snapshot(b.model.state_dict(), v, torch.bfloat16, tied, bg.spare(), check=False))
            ours.append(b.wait_applied(v, t0, procs))
            state = b.published_state()
            t1 = time.perf_counter()
            save_file(state, str(raw_dir / "raw.safetensors"))

            def get(_):
                with urllib.request.urlopen(f"http://127.0.0.1:{plain.server_address[1]}/raw.safetensors") as resp:
                    return len(load_bytes(resp.read()))

            with ThreadPoolExecutor(len(procs)) as pool:
                loaded = list(pool.map(get, range(len(procs))))
            raw.append(time.perf_counter() - t1)
            assert loaded == [len(state)] * len(procs)
        bg.close()
        warmup = ours[:WARMUP]
        ours, raw = ours[WARMUP:], raw[WARMUP:]
        a = bg.last
        nbytes = sum(f.stat().st_size for f in Path(a.path).iterdir())
        served = server.counts["bytes_sent"]
    finally:
        if procs:
            b.stop(procs)
        server.close()
        plain.shutdown()
        plain.server_close()
    return row(
        "weight_sync/http",
        statistics.median(ours),
        statistics.median(raw),
        UNIT,
        TARGETS["http"],
        "lower",
        {
            **b.details,
            "versions": b.versions,
            "per_version_s": ours,
            "raw_per_version_s": raw,
            "version_bytes": nbytes,
            "bytes_served": served,
            "shard_mb": shard_mb,
            "warmup_s": warmup,
            "raw": f"safetensors save_file, then {len(procs)} concurrent plain HTTP GETs of the file (stdlib "
            "http.server), each loaded with safetensors.torch.load",
        },
    )


# -- the collective transport (weights.transport = "collective"; learner/broadcast.py) -----------------------


def _collective_peer(
    redis_url: str,
    key_file: str,
    model: str,
    gid: str,
    raw_addr: str,
    rank: int,
    rounds: int,
    total: int,
    bucket_mb: float,
    weights_key_file: str,
) -> None:
    """A generator's side, in its own process: the torch backend, a WeightApplier with the real Receiver
    (generators/weight_receive.py), plus rank ``rank`` of a plain gloo group for the raw baseline. Each
    round: receive ``total`` bytes by ``torch.distributed.broadcast``, then apply what the collective
    transport brings (its ``applied`` events carry the time)."""
    import threading

    import torch
    import torch.distributed as dist

    from broker.client.connection import connect_redis
    from broker.protocol.keys import Keys
    from broker.protocol.signing import read_verifier
    from broker.protocol.weightauth import read_key_file
    from broker.protocol.weights_config import CollectiveTransport
    from generators.config import TorchBackendConfig
    from generators.weight_receive import Receiver
    from generators.weights import WeightApplier

    torch.set_num_threads(1)
    r, keys = connect_redis(redis_url), Keys("bench-coll")
    key = read_verifier(key_file)
    weights_key = read_key_file(weights_key_file)
    backend = TorchBackendConfig(dtype="bfloat16").build()  # as the other rows' generators
    backend.load(model)
    receiver = Receiver(r, keys, CollectiveTransport(bucket_mb=bucket_mb, timeout_s=120), gid, key, weights_key).start()
    w = WeightApplier(r, keys, backend, gid, announce_key=key, receiver=receiver)
    w.version = 0

    def raw() -> None:
        host, port = raw_addr.split(":")
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=3)
        buf = torch.empty(total, dtype=torch.uint8)
        for _ in range(rounds):
            dist.broadcast(buf, 0)

    t = threading.Thread(target=raw, daemon=True)
    t.start()
    while w.version < rounds:
        w.update()
        time.sleep(0.002)
    t.join()
    receiver.close()


def _bench_collective(b: Bench) -> dict:
    """The ``weight_sync/collective`` row: seconds from the start of ``Publisher.publish`` (with the
    collective broadcaster: broadcast first, the store copy behind) until 2 generator processes have
    applied the version via the collective (the latest of their ``applied`` events), against the same
    bytes broadcast by plain ``torch.distributed.broadcast`` over one gloo group of the same 3 processes
    (rounds alternate; medians). Buckets of 64 MiB (1/16 MiB with ``--quick``, so that there are several)."""
    import datetime
    import subprocess
    import sys

    import redis
    import torch
    import torch.distributed as dist

    from broker.client import queues
    from broker.client.telemetry import read_events
    from broker.protocol import collective as wire
    from broker.protocol.keys import Keys
    from broker.protocol.weights_config import CollectiveTransport
    from deploy.launcher.procs import free_port
    from learner.broadcast import Broadcaster
    from learner.publish import Publisher
    from benchmarks.common import ROOT, child_env

    rounds, bucket_mb = WARMUP + 2 * b.versions - 1, (1 / 16 if b.quick else 64.0)  # cheap rounds: more of them
    keys = Keys("bench-coll")
    stack, base, model, tokenizer, tmp = b.stack, b.base, b.model, b.tokenizer, b.tmp / "collective"
    tmp.mkdir()
    url = stack.redis()
    r = redis.Redis.from_url(url)
    queues.ensure_groups(r, keys)
    bc = Broadcaster(
        r,
        keys,
        CollectiveTransport(bucket_mb=bucket_mb, timeout_s=120),
        stack.announce_key,
        weights_key=stack.weights_key,
    ).start()
    pub = Publisher(
        r,
        keys,
        str(Path(tmp) / "weights"),
        tokenizer,
        keep_versions=2,
        announce_key=stack.announce_key,
        dtype=torch.bfloat16,
        broadcaster=bc,
    )
    send_s: list[float] = []  # of each publication: the broadcast (Broadcaster.send), for the breakdown
    send = bc.send

    def timed_send(version, state, **kw):
        t = time.perf_counter()
        try:
            return send(version, state, **kw)
        finally:
            send_s.append(time.perf_counter() - t)

    bc.send = timed_send
    state0 = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    total = wire.plan(
        [(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state0.items()], 1 << 20
    ).total
    raw_addr = f"127.0.0.1:{free_port()}"
    peers = []
    for i in range(2):
        code = (
            f"from benchmarks.weight_sync import _collective_peer; _collective_peer({url!r}, "
            f"{stack.announce_public_key_file!r}, {str(base)!r}, 'gen-{i}', {raw_addr!r}, {i + 1}, {rounds}, "
            f"{total}, {bucket_mb}, {stack.weights_key_file!r})"
        )
        peers.append(
            subprocess.Popen(
                [sys.executable, "-c", code], env=child_env(), cwd=ROOT, stderr=open(Path(tmp) / f"gen-{i}.log", "w")
            )
        )

    def alive() -> bool:
        for i, p in enumerate(peers):
            if p.poll() not in (None, 0):  # 0: it applied every round and left (the main may not have looked yet)
                raise RuntimeError(
                    f"generator gen-{i} exited ({p.returncode}):\n{(Path(tmp) / f'gen-{i}.log').read_text()[-2000:]}"
                )
        return True

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://{raw_addr}", rank=0, world_size=3, timeout=datetime.timedelta(seconds=600)
        )
        wait_until(
            lambda: alive() and bc.member_ids() == ["gen-0", "gen-1"], 600, "both generators to join the broadcast"
        )
        ours, raw, receive_s = [], [], []
        flat = torch.zeros(total, dtype=torch.uint8)
        for v in range(1, rounds + 1):
            b.new_weights()
            t1 = time.perf_counter()
            dist.broadcast(flat, 0)  # the raw baseline: the same bytes, the same processes, one call
            raw.append(time.perf_counter() - t1)
            t0 = time.time()
            pub.publish(model, model.state_dict(), v)
            wait_until(
                lambda: (
                    alive()
                    and sorted(
                        e.data["generator"]
                        for _, e in read_events(r, keys, "0-0", 10**6)
                        if e.kind == "applied" and e.data["version"] == v
                    )
                    == ["gen-0", "gen-1"]
                ),
                300,
                f"both generators to apply version {v}",
            )
            applied = [
                e for _, e in read_events(r, keys, "0-0", 10**6) if e.kind == "applied" and e.data["version"] == v
            ]
            assert all(e.data["via"] == "collective" for e in applied)
            ours.append(max(e.t for e in applied) - t0)
            receive_s.append(max(e.data["latency_s"] for e in applied))
        for p in peers:
            p.wait(timeout=120)
        warmup = ours[:WARMUP]
        ours, raw, receive_s, send_s = (x[WARMUP:] for x in (ours, raw, receive_s, send_s))
    finally:
        for p in peers:
            if p.poll() is None:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        bc.close()
    params = sum(p.numel() for p in model.parameters())
    return row(
        "weight_sync/collective",
        statistics.median(ours),
        statistics.median(raw),
        UNIT,
        TARGETS["collective"],
        "lower",
        {
            **b.details,
            "model_params": params,
            "bytes": total,
            "bucket_mb": bucket_mb,
            "versions": rounds - WARMUP,
            "warmup_s": warmup,
            "per_version_s": ours,
            "raw_per_version_s": raw,
            # where the time goes: the learner's broadcast (copy, send, digest, trailer: the rest of
            # `publish` before it is the non-finite check), a generator's header -> applied
            "broadcast_s": send_s,
            "receive_to_applied_s": receive_s,
            "broadcast_s_median": statistics.median(send_s),
            "receive_to_applied_s_median": statistics.median(receive_s),
            "raw": "torch.distributed.broadcast of the same bytes over gloo, learner -> the same 2 processes",
        },
    )


# -- LoRA adapters published alone (learner.lora.publish = adapter; docs/weights.md "LoRA adapters") -------------

LORA_RANK, LORA_ALPHA = 16, 32.0


def _bench_lora(b: Bench) -> dict:
    """The ``lora`` row: the same model with LoRA adapters (rank 16 on every linear layer but the head), each
    version the adapter alone through the store transport (the learner's publisher; 2 generators verifying
    and loading it in place), against the full-weights ``store`` row of the same model in the same run.
    Runs last: peft adds the adapters to the benchmark's model in place."""
    import torch

    from broker.protocol import weightstore
    from learner.config import LoraConfig
    from learner.lora import adapter_config, adapter_publication, apply_lora
    from learner.publish import BackgroundPublisher, Publisher, snapshot

    if b.full_store_s is None:
        return skipped("weight_sync/lora", "the store row, its baseline, did not run", UNIT, TARGETS["lora"], "lower")
    model = apply_lora(b.model, LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA)).to(torch.bfloat16)
    store = b.tmp / "weights-lora"
    pub = Publisher(
        b.r,
        b.keys,
        str(store),
        b.tokenizer,
        keep_versions=3,
        announce_key=b.stack.announce_key,
        dtype=torch.bfloat16,
        shard_mb=0.25 if b.quick else 2048.0,
    )
    pub.adapter_config = adapter_config(model)
    tied = bool(b.model.config.tie_word_embeddings)
    bg = BackgroundPublisher(pub, b.model.config)

    def step() -> tuple[int, dict]:
        """A step's change to the adapters, and what the next version carries."""
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_" in n:
                    p.add_(1e-3)
        b.next_version += 1
        return b.next_version, adapter_publication(model.state_dict(), pub.needs_base)

    v, weights = step()  # the first version carries the base model (a generator starts from it)
    bg.submit(v, snapshot(weights, v, torch.bfloat16, tied))
    bg.drain()
    procs = b.generators({"transport": {"type": "store"}}, str(store))
    try:
        b.wait_applied(v, 0.0, procs)
        ours, blocked = [], []
        for _ in range(WARMUP + b.versions):
            v, weights = step()
            t0 = time.time()
            bg.submit(v, snapshot(weights, v, torch.bfloat16, tied, bg.spare(), check=False))
            blocked.append(time.time() - t0)
            ours.append(b.wait_applied(v, t0, procs))
        bg.close()
        warmup, ours, blocked = ours[:WARMUP], ours[WARMUP:], blocked[WARMUP:]
    finally:
        b.stop(procs)
    a = bg.last
    assert a.adapter_only, a
    files = weightstore.read_manifest(a.path)["files"]
    adapter_params = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    return row(
        "weight_sync/lora",
        statistics.median(ours),
        b.full_store_s,
        UNIT,
        TARGETS["lora"],
        "lower",
        {
            "rank": LORA_RANK,
            "alpha": LORA_ALPHA,
            "target_modules": "all-linear",
            "adapter_params": adapter_params,
            "adapter_bytes": sum((Path(a.path) / f).stat().st_size for f in files),
            "full_bytes": b.details.get("full_bytes"),
            "versions": b.versions,
            "per_version_s": ours,
            "learner_blocked_s": blocked,
            "warmup_s": warmup,
            "baseline": "the store row: the same model's full weights, publish -> applied on 2, in this run",
        },
    )


TRANSPORTS = (_bench_store, _bench_http, _bench_collective, _bench_lora)


def run(quick: bool, include_vllm: bool = False) -> list[dict]:
    """One row per transport, torch backend (``include_vllm`` is accepted for ``relay bench``'s interface;
    the vLLM backend's update path is measured by ``relay bench generator``)."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="relay-bench-weights-") as tmp, Stack(Path(tmp)) as stack:
        b = Bench(Path(tmp), stack, quick, versions=2 if quick else 5)
        b.setup()
        for bench in TRANSPORTS:
            out = bench(b)
            rows.extend(out if isinstance(out, list) else [out])
    return rows
