"""Reward scoring throughput: the built-in exact-match plugin through the HTTP service, against the
same plugin called in-process (the cost of the HTTP hop).

    .venv/bin/python -m benchmarks.rewards          # full size (figures in docs/rewards.md)
    .venv/bin/python -m benchmarks.rewards --quick  # a few seconds

The service runs as its own process (``relay reward``), as in a real run; one client sends batches
back to back over a kept-alive connection and parses every reply. Request bodies are encoded once
beforehand (building them is the caller's cost, not the service's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TARGET = 5000.0


def make_items(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ref = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 8)))
        comp = ref if rng.random() < 0.5 else ref[::-1]
        out.append({"prompt": ref + "=", "completion": comp, "reference": ref, "task": "exact_match"})
    return out


def in_process(batches: list[list[dict]], repeats: int) -> float:
    """Items/s of ExactMatch.score called directly (the plugin alone)."""
    from reward_service.plugins import REGISTRY, Item

    plugin = REGISTRY["exact_match"]()
    items = [[Item(**it) for it in b] for b in batches]

    async def go():
        for _ in range(repeats):
            for b in items:
                res = await plugin.score(b)
                assert len(res) == len(b)

    t0 = time.perf_counter()
    asyncio.run(go())
    return repeats * sum(map(len, batches)) / (time.perf_counter() - t0)


def over_http(batches: list[list[dict]], repeats: int) -> tuple[float, float]:
    """(items/s, ms per batch) through a real ``relay reward`` process."""
    from deploy.launcher.procs import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp, "reward.json")
        cfg.write_text(json.dumps({"port": port}))
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "reward", "--config", str(cfg)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"relay reward exited: {proc.stderr.read().decode()[-2000:]}")
                try:
                    if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.1)
            bodies = [json.dumps({"items": b}).encode() for b in batches]
            with httpx.Client(base_url=base, timeout=60, headers={"Content-Type": "application/json"}) as c:
                c.post("/score", content=bodies[0]).raise_for_status()  # warm-up
                t0 = time.perf_counter()
                for _ in range(repeats):
                    for body, b in zip(bodies, batches):
                        r = c.post("/score", content=body)
                        r.raise_for_status()
                        results = r.json()["results"]
                        assert len(results) == len(b) and results[0]["status"] == "ok"
                dt = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(10)
    n = repeats * sum(map(len, batches))
    return n / dt, 1000 * dt / (repeats * len(batches))


def run(quick: bool) -> dict:
    batch, nbatches, repeats = (256, 4, 2) if quick else (1024, 16, 5)
    items = make_items(batch * nbatches)
    batches = [items[i : i + batch] for i in range(0, len(items), batch)]
    baseline = in_process(batches, repeats * (1 if quick else 20))
    value, ms = over_http(batches, repeats)
    return {
        "name": "reward_http",
        "value": value,
        "baseline": baseline,
        "ratio": value / baseline,
        "target": TARGET,
        "unit": "items/s",
        "details": {
            "batch": batch,
            "batches": nbatches * repeats,
            "ms_per_batch_http": ms,
            "http_overhead_us_per_item": 1e6 / value - 1e6 / baseline,
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (seconds)")
    r = run(ap.parse_args().quick)
    d = r["details"]
    print(f"{'measure':<44}{'value':>14}")
    print(f"{'exact_match through HTTP (items/s)':<44}{r['value']:>14,.0f}")
    print(f"{'exact_match in-process (items/s)':<44}{r['baseline']:>14,.0f}")
    print(f"{'ratio HTTP / in-process':<44}{r['ratio']:>14.4f}")
    print(f"{'HTTP overhead per item (µs)':<44}{d['http_overhead_us_per_item']:>14.1f}")
    print(f"{'batch size':<44}{d['batch']:>14}")
    print(f"{'ms per batch through HTTP':<44}{d['ms_per_batch_http']:>14.2f}")
    print(f"{'target (items/s)':<44}{r['target']:>14,.0f}  {'met' if r['value'] >= r['target'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
