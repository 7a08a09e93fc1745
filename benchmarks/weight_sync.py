"""weight_sync: seconds from the start of a publication (the learner's ``Publisher.publish``: safetensors
file, tokenizer, sha256 manifest, rename, announcement) until 2 running ``relay generator`` processes
have applied it (each verifies every file against the manifest and loads the weights in place; the
time is that of its ``applied`` event), against a raw ``safetensors`` save and load of the same weights.

A ~52M-parameter model (the tiny model's tokenizer, hidden 640, 8 layers), for the torch backend and
the vLLM backend; the vLLM row is skipped, with the reason, when vLLM or its backend is missing.
Versions and raw copies alternate; the figure is the median over the versions.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import Stack, bench_model, row, skipped, wait_until

TARGET = 3.0


def vllm_missing() -> str | None:
    """Why the vLLM rows cannot run here, or None when they can."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed in this environment"
    if importlib.util.find_spec("generators.backends.vllm") is None:
        return "generators/backends/vllm.py (the vLLM backend) does not exist yet"
    return None


def backend_config(kind: str) -> dict:
    if kind == "torch":
        return {"type": "torch"}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM on CPU fails at start-up without it
    return {"type": "vllm"}


def measure(kind: str, quick: bool) -> dict:
    import redis
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from broker.protocol import weightstore
    from broker.client import queues
    from broker.client.telemetry import read_events, read_heartbeats
    from broker.protocol.keys import Keys
    from deploy.launcher.procs import free_port
    from learner.publish import Publisher

    versions = 2 if quick else 5
    keys = Keys("bench")
    with tempfile.TemporaryDirectory(prefix="relay-bench-weights-") as tmp, Stack(Path(tmp)) as stack:
        base = bench_model(Path(tmp) / "base", quick)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(base)
        url = stack.redis()
        r = redis.Redis.from_url(url)
        queues.ensure_groups(r, keys)  # no prompts: the generators idle
        pub = Publisher(r, keys, str(Path(tmp) / "weights"), tokenizer, keep_versions=3,
                        announce_key=stack.announce_key)
        pub.publish(model, model.state_dict(), 0)
        gens = [stack.service(f"gen-{i}", "generator", {
            "id": f"gen-{i}", "run_id": "bench", "redis_url": url, "broker_address": f"tcp://127.0.0.1:{free_port()}",
            "backend": backend_config(kind), "heartbeat_s": 0.05}) for i in range(2)]

        def served() -> list:
            hb = read_heartbeats(r, keys)
            return [hb[g].version if g in hb else None for g in ("gen-0", "gen-1")]

        for g in gens:
            wait_until(lambda: served()[int(g.name[-1])] == 0, 600, f"{g.name} to load version 0", g)
        ours, raw, publish_s = [], [], []
        for v in range(1, versions + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-4)  # new weights each version
            t0 = time.time()
            a = pub.publish(model, model.state_dict(), v)
            publish_s.append(time.time() - t0)
            wait_until(lambda: served() == [v, v], 120, f"both generators to apply version {v}")
            applied = [e for _, e in read_events(r, keys, "0-0", 10**6) if e.kind == "applied"]
            ours.append(max(e.t for e in applied if e.data["version"] == v) - t0)
            state = {k: t.detach().contiguous() for k, t in model.state_dict().items() if k != "lm_head.weight"}
            t1 = time.perf_counter()
            save_file(state, str(Path(tmp) / "raw.safetensors"))
            back = load_file(str(Path(tmp) / "raw.safetensors"))
            raw.append(time.perf_counter() - t1)
            assert len(back) == len(state)
        # where the time goes, measured once in this process: verify the snapshot, load it in place
        t2 = time.perf_counter()
        weightstore.verify(a.path, a.hash)
        verify_s = time.perf_counter() - t2
        load_s = None
        if kind == "torch":
            from generators.config import TorchBackendConfig
            from generators.backends.torch import TorchBackend

            tb = TorchBackend(TorchBackendConfig())
            tb.load(a.path)
            t3 = time.perf_counter()
            tb.update_weights(a.path)
            load_s = time.perf_counter() - t3
        params = sum(p.numel() for p in model.parameters())
        nbytes = (Path(a.path) / "model.safetensors").stat().st_size
    return row(f"weight_sync/{kind}", statistics.median(ours), statistics.median(raw), "s publish -> applied on 2",
               TARGET, "lower", {
                   "model_params": params, "safetensors_bytes": nbytes, "versions": versions,
                   "per_version_s": ours, "raw_per_version_s": raw, "publish_s_median": statistics.median(publish_s),
                   "verify_s_one_generator": verify_s, "update_weights_s_one_generator": load_s,
                   "raw": "safetensors save_file + load_file of the same tensors"})


def run(quick: bool, include_vllm: bool = True) -> list[dict]:
    rows = [measure("torch", quick)]
    why = vllm_missing() if include_vllm else "skipped in --quick mode (vLLM starts in ~20 s); name it to run it"
    rows.append(skipped("weight_sync/vllm", why, "s publish -> applied on 2", TARGET, "lower") if why
                else measure("vllm", quick))
    return rows


# -- the collective transport (weights.transport = "collective"; learner/broadcast.py) -----------------------

COLLECTIVE_TARGET = 1.5


def _collective_peer(redis_url: str, key_file: str, model: str, gid: str, raw_addr: str, rank: int,
                     rounds: int, total: int, bucket_mb: float) -> None:
    """A generator's side, in its own process: the torch backend, a WeightApplier with the real Receiver
    (generators/weight_receive.py), plus rank ``rank`` of a plain gloo group for the raw baseline. Each
    round: receive ``total`` bytes by ``torch.distributed.broadcast``, then apply what the collective
    transport brings (its ``applied`` events carry the time)."""
    import threading

    import torch
    import torch.distributed as dist

    from broker.client.connection import connect_redis
    from broker.protocol.keys import Keys
    from broker.protocol.signing import read_key_file
    from broker.runtime.config import CollectiveWeightsConfig
    from generators.config import TorchBackendConfig
    from generators.weight_receive import Receiver
    from generators.weights import WeightApplier

    torch.set_num_threads(1)
    r, keys = connect_redis(redis_url), Keys("bench-coll")
    key = read_key_file(key_file)
    backend = TorchBackendConfig().build()
    backend.load(model)
    receiver = Receiver(r, keys, CollectiveWeightsConfig(bucket_mb=bucket_mb, timeout_s=120), gid, key).start()
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


def _bench_collective(quick: bool, model_dir: str | Path | None = None, bucket_mb: float = 64.0) -> dict:
    """The ``weight_sync/collective`` row: seconds from the start of ``Publisher.publish`` (with the
    collective broadcaster: broadcast first, the store copy behind) until 2 generator processes have
    applied the version via the collective (the latest of their ``applied`` events), against the same
    bytes broadcast by plain ``torch.distributed.broadcast`` over one gloo group of the same 3 processes
    (rounds alternate; medians). ``model_dir``: the model to publish (default: :func:`bench_model`)."""
    import datetime
    import subprocess
    import sys

    import redis
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from broker.client import queues
    from broker.client.telemetry import read_events
    from broker.protocol import collective as wire
    from broker.protocol.keys import Keys
    from broker.runtime.config import CollectiveWeightsConfig
    from deploy.launcher.procs import free_port
    from learner.broadcast import Broadcaster
    from learner.publish import Publisher
    from tests.support.services import ROOT, child_env

    rounds = 2 if quick else 5
    keys = Keys("bench-coll")
    with tempfile.TemporaryDirectory(prefix="relay-bench-coll-") as tmp, Stack(Path(tmp)) as stack:
        base = Path(model_dir) if model_dir else bench_model(Path(tmp) / "base", quick)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(base)
        url = stack.redis()
        r = redis.Redis.from_url(url)
        queues.ensure_groups(r, keys)
        b = Broadcaster(r, keys, CollectiveWeightsConfig(bucket_mb=bucket_mb, timeout_s=120), stack.announce_key).start()
        pub = Publisher(r, keys, str(Path(tmp) / "weights"), tokenizer, keep_versions=2,
                        announce_key=stack.announce_key, broadcaster=b)
        send_s: list[float] = []  # of each publication: the broadcast (Broadcaster.send), for the breakdown
        send = b.send

        def timed_send(version, state):
            t = time.perf_counter()
            try:
                return send(version, state)
            finally:
                send_s.append(time.perf_counter() - t)

        b.send = timed_send
        state0 = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        total = wire.plan([(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state0.items()],
                          1 << 20).total
        raw_addr = f"127.0.0.1:{free_port()}"
        peers = []
        for i in range(2):
            code = (f"from benchmarks.weight_sync import _collective_peer; _collective_peer({url!r}, "
                    f"{stack.announce_key_file!r}, {str(base)!r}, 'gen-{i}', {raw_addr!r}, {i + 1}, {rounds}, "
                    f"{total}, {bucket_mb})")
            peers.append(subprocess.Popen([sys.executable, "-c", code], env=child_env(), cwd=ROOT,
                                          stderr=open(Path(tmp) / f"gen-{i}.log", "w")))
        def alive() -> bool:
            for i, p in enumerate(peers):
                if p.poll() is not None:
                    raise RuntimeError(f"generator gen-{i} exited ({p.returncode}):\n"
                                       f"{(Path(tmp) / f'gen-{i}.log').read_text()[-2000:]}")
            return True

        try:
            dist.init_process_group("gloo", init_method=f"tcp://{raw_addr}", rank=0, world_size=3,
                                    timeout=datetime.timedelta(seconds=600))
            wait_until(lambda: alive() and b.member_ids() == ["gen-0", "gen-1"], 600, "both generators to join the broadcast")
            ours, raw, receive_s = [], [], []
            flat = torch.zeros(total, dtype=torch.uint8)
            for v in range(1, rounds + 1):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1e-4)
                t1 = time.perf_counter()
                dist.broadcast(flat, 0)  # the raw baseline: the same bytes, the same processes, one call
                raw.append(time.perf_counter() - t1)
                t0 = time.time()
                pub.publish(model, model.state_dict(), v)
                wait_until(lambda: alive() and sorted(e.data["generator"] for _, e in read_events(r, keys, "0-0", 10**6)
                                          if e.kind == "applied" and e.data["version"] == v) == ["gen-0", "gen-1"],
                           300, f"both generators to apply version {v}")
                applied = [e for _, e in read_events(r, keys, "0-0", 10**6) if e.kind == "applied"
                           and e.data["version"] == v]
                assert all(e.data["via"] == "collective" for e in applied)
                ours.append(max(e.t for e in applied) - t0)
                receive_s.append(max(e.data["latency_s"] for e in applied))
            for p in peers:
                p.wait(timeout=120)
        finally:
            for p in peers:
                if p.poll() is None:
                    p.kill()
            if dist.is_initialized():
                dist.destroy_process_group()
            b.close()
        params = sum(p.numel() for p in model.parameters())
    return row("weight_sync/collective", statistics.median(ours), statistics.median(raw),
               "s publish -> applied on 2", COLLECTIVE_TARGET, "lower", {
                   "model_params": params, "bytes": total, "bucket_mb": bucket_mb, "versions": rounds,
                   "per_version_s": ours, "raw_per_version_s": raw,
                   # where the time goes: the learner's broadcast (copy, send, digest, trailer: the rest of
                   # `publish` before it is the non-finite check), a generator's header -> applied
                   "broadcast_s_median": statistics.median(send_s),
                   "receive_to_applied_s_median": statistics.median(receive_s),
                   "raw": "torch.distributed.broadcast of the same bytes over gloo, learner -> the same 2 processes"})
