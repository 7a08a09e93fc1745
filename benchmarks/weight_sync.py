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


def _bench_http(model, tokenizer, workdir: Path, stack, versions: int = 3, generators: int = 2,
                run_id: str = "bench-http") -> dict:
    """The ``http`` transport's row (engineer B; self-contained, the caller gives the model, its tokenizer, a
    work folder and a running :class:`benchmarks.common.Stack`): seconds from the start of a publication
    (``Publisher.publish`` into a store that only the learner's weight server reads) until ``generators``
    ``relay generator`` processes with ``weights.transport = "http"`` and no weight store have fetched it
    over HTTP, verified it and applied it (their ``applied`` events), median over ``versions``; against a
    raw baseline measured in the same run on the same machine: ``save_file`` of the same tensors, then one
    plain HTTP GET of those bytes per generator, concurrently, from a stdlib ``http.server``, each loaded
    with ``safetensors.torch.load`` (what a transfer with no manifest, no hash and no engine costs)."""
    import functools
    import http.server
    import threading
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    import redis
    import torch
    from safetensors.torch import load as load_bytes, save_file

    from broker.client import queues
    from broker.client.telemetry import read_events, read_heartbeats
    from broker.protocol.keys import Keys
    from broker.protocol.weightauth import bearer_token
    from deploy.launcher.procs import free_port
    from learner.publish import Publisher
    from learner.weight_server import WeightServer

    keys = Keys(run_id)
    url = stack.redis()
    r = redis.Redis.from_url(url)
    queues.ensure_groups(r, keys)  # no prompts: the generators idle
    store, raw_dir = workdir / "http-store", workdir / "http-raw"
    store.mkdir(parents=True, exist_ok=True)
    raw_dir.mkdir(parents=True, exist_ok=True)
    server = WeightServer(store, token=bearer_token(stack.announce_key, run_id)).start()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(raw_dir)))
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    try:
        pub = Publisher(r, keys, str(store), tokenizer, keep_versions=3, announce_key=stack.announce_key)
        pub.url_for = server.url
        pub.publish(model, model.state_dict(), 0)
        names = [f"{run_id}-gen-{i}" for i in range(generators)]
        procs = [stack.service(name, "generator", {
            "id": name, "run_id": run_id, "redis_url": url, "broker_address": f"tcp://127.0.0.1:{free_port()}",
            "backend": {"type": "torch"}, "heartbeat_s": 0.05, "weight_store": "",
            "weights": {"transport": "http", "http": {"cache_dir": str(workdir / f"http-cache-{i}")}}})
            for i, name in enumerate(names)]

        def served() -> list:
            hb = read_heartbeats(r, keys)
            return [hb[g].version if g in hb else None for g in names]

        for i, p in enumerate(procs):
            wait_until(lambda: served()[i] == 0, 600, f"{names[i]} to load version 0 over http", p)
        ours, raw, publish_s = [], [], []
        for v in range(1, versions + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-4)  # new weights each version
            t0 = time.time()
            pub.publish(model, model.state_dict(), v)
            publish_s.append(time.time() - t0)
            wait_until(lambda: served() == [v] * generators, 300, f"the generators to apply version {v} over http")
            applied = [e for _, e in read_events(r, keys, "0-0", 10**6) if e.kind == "applied"]
            ours.append(max(e.t for e in applied if e.data["version"] == v) - t0)
            # the raw baseline: the same tensors saved, then one plain GET per generator, loaded from the bytes
            state = {k: t.detach().contiguous() for k, t in model.state_dict().items()
                     if not (k == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False))}
            t1 = time.perf_counter()
            save_file(state, str(raw_dir / "raw.safetensors"))

            def get(_):
                with urllib.request.urlopen(f"http://127.0.0.1:{plain.server_address[1]}/raw.safetensors") as resp:
                    return len(load_bytes(resp.read()))

            with ThreadPoolExecutor(generators) as pool:
                loaded = list(pool.map(get, range(generators)))
            raw.append(time.perf_counter() - t1)
            assert loaded == [len(state)] * generators
        nbytes = sum(f.stat().st_size for f in (store / f"v{versions:06d}").iterdir())
        fetched = server.counts["bytes_sent"]
    finally:
        server.close()
        plain.shutdown()
        plain.server_close()
    return row("weight_sync/http", statistics.median(ours), statistics.median(raw),
               f"s publish -> applied on {generators}", 2.0, "lower", {
                   "model_params": sum(p.numel() for p in model.parameters()), "version_bytes": nbytes,
                   "versions": versions, "per_version_s": ours, "raw_per_version_s": raw,
                   "publish_s_median": statistics.median(publish_s), "bytes_served": fetched,
                   # fetch + verify + load on the slower generator, once the learner has announced
                   "after_publish_s_median": statistics.median(o - p for o, p in zip(ours, publish_s)),
                   "raw": f"safetensors save_file, then {generators} concurrent plain HTTP GETs of the file "
                          "(stdlib http.server) loaded with safetensors.torch.load"})

