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
