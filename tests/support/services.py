"""Helpers for tests that start real processes: the environment children get, services started from a
config on free ports and waited for, the ``relay`` command run as a user would, polling helpers."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from broker.protocol.ingest_auth import CurveClientKeys, load_client_keys, write_ingest_keys
from broker.protocol import weightauth
from broker.protocol.signing import AnnounceSigner, read_signer, write_key_pair
from deploy.launcher.procs import Child, ProcessGroup, free_port

ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict:
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false"
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    return env


def ingest_test_keys(tmp_path: Path) -> dict:
    """The ingest keys of a test (made once per ``tmp_path``): a broker certificate and one producer key
    that the allow-list lets send as any generator id ("*"), for tests of things other than the
    binding of keys to ids (those write their own with write_ingest_keys)."""
    d = tmp_path / "ingest-keys"
    if not (d / "clients.json").exists():
        write_ingest_keys(d, ["test-producer"], patterns={"test-producer": "*"})
    return {
        "broker_key_file": str(d / "broker.key_secret"),
        "broker_public_key_file": str(d / "broker.key"),
        "clients_file": str(d / "clients.json"),
        "producer_key_file": str(d / "generator-test-producer.key_secret"),
    }


def producer_keys(tmp_path: Path) -> CurveClientKeys:
    """The test producer's CURVE keys, for a GroupSender (``GroupSender(address, curve=producer_keys(tmp_path))``)."""
    k = ingest_test_keys(tmp_path)
    return load_client_keys(k["producer_key_file"], k["broker_public_key_file"])


def with_ingest_keys(service: str, cfg: dict, tmp_path: Path) -> dict:
    """``cfg`` with the test's CURVE keys (ingest_test_keys) for a broker or a generator that does not set
    ingest_auth itself: authenticated ingest is what every test runs unless it says otherwise."""
    if service not in ("broker", "generator") or "ingest_auth" in cfg:
        return cfg
    k = ingest_test_keys(tmp_path)
    if service == "broker":
        return {"ingest_key_file": k["broker_key_file"], "ingest_clients_file": k["clients_file"], **cfg}
    return {"ingest_key_file": k["producer_key_file"], "broker_public_key_file": k["broker_public_key_file"], **cfg}


def announce_key_file(tmp_path: Path) -> Path:
    """The private announcement key of the services a test starts (the key pair made on first use, one per
    test): the learner's."""
    return write_key_pair(tmp_path / "announce.key", tmp_path / "announce.pub")[0]


def announce_public_key_file(tmp_path: Path) -> Path:
    """Its public half: the broker's and the generators'."""
    return write_key_pair(tmp_path / "announce.key", tmp_path / "announce.pub")[1]


def announce_key(tmp_path: Path) -> AnnounceSigner:
    """That key, for a test that publishes (``Publisher``, ``announce``) to the services it started; it
    verifies too (a test's WeightApplier, ``latest_announcement``)."""
    return read_signer(announce_key_file(tmp_path))


def weights_key_file(tmp_path: Path) -> Path:
    """The run's weights key of a test (the http server's token, collective joins; one per test)."""
    return weightauth.write_key_file(tmp_path / "weights.key")


def weights_key(tmp_path: Path) -> bytes:
    return weightauth.read_key_file(weights_key_file(tmp_path))


def with_run_keys(service: str, cfg: dict, tmp_path: Path) -> dict:
    """``cfg`` with the test's keys unless it sets them: the private announcement key for a learner, the
    public one for a broker or a generator (announce_auth ed25519), the weights key for a learner or a
    generator (weights.auth key)."""
    signs = cfg.get("announce_auth", "ed25519") == "ed25519"
    if service == "learner" and signs and "announce_key_file" not in cfg:
        cfg = {**cfg, "announce_key_file": str(announce_key_file(tmp_path))}
    if service in ("broker", "generator") and signs and "announce_public_key_file" not in cfg:
        cfg = {**cfg, "announce_public_key_file": str(announce_public_key_file(tmp_path))}
    weights = dict(cfg.get("weights") or {})
    if service in ("learner", "generator") and weights.get("auth", "key") == "key" and "key_file" not in weights:
        cfg = {**cfg, "weights": {**weights, "key_file": str(weights_key_file(tmp_path))}}
    return cfg


def start_service(procs: ProcessGroup, name: str, service: str, cfg: dict, tmp_path: Path):
    """``relay <service>`` with ``cfg``; brokers and generators get the test's CURVE keys unless ``cfg``
    sets ingest_auth, and the broker, learner and generators the test's announcement and weights keys
    (:func:`with_run_keys`) unless ``cfg`` says otherwise."""
    cfg = with_run_keys(service, with_ingest_keys(service, cfg, tmp_path), tmp_path)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return procs.start(
        name, [sys.executable, "-m", "deploy.cli", service, "--config", str(path)], env=child_env(), cwd=str(ROOT)
    )


@dataclass
class Services:
    """A broker and a reward service running as real processes on free ports, both healthy."""

    broker: Child
    reward: Child
    ingest: str  # the broker's ZeroMQ address, for generators' broker_address
    http: str  # the broker's HTTP base URL (dashboard, /healthz)
    reward_url: str


def start_broker_and_reward(procs: ProcessGroup, redis_url: str, tmp_path: Path, run: str, **broker_cfg) -> Services:
    """Start ``relay broker`` (run ``run``, with ``broker_cfg`` on top) and ``relay reward``; wait until both answer."""
    ingest, http, reward = free_port(), free_port(), free_port()
    b = start_service(
        procs,
        "broker",
        "broker",
        {
            "run_id": run,
            "redis_url": redis_url,
            "http_port": http,
            "ingest_bind": f"tcp://127.0.0.1:{ingest}",
            **broker_cfg,
        },
        tmp_path,
    )
    rw = start_service(procs, "reward", "reward", {"port": reward}, tmp_path)
    wait_http(f"http://127.0.0.1:{http}/healthz", b)
    wait_http(f"http://127.0.0.1:{reward}/healthz", rw)
    return Services(b, rw, f"tcp://127.0.0.1:{ingest}", f"http://127.0.0.1:{http}", f"http://127.0.0.1:{reward}")


def generator_cfg(svc: Services, redis_url: str, run: str, gid: str, **cfg) -> dict:
    """A ``relay generator`` config wired to ``svc`` (with ``cfg`` on top)."""
    return {
        "id": gid,
        "run_id": run,
        "redis_url": redis_url,
        "broker_address": svc.ingest,
        "reward_url": svc.reward_url,
        **cfg,
    }


class RecordingBackend:
    """A generator backend that loads nothing: it records the folders it was given (``load`` and
    ``update_weights``), for tests of which versions a WeightApplier applies."""

    name = "stub"

    def __init__(self):
        self.loaded = []

    def load(self, path):
        self.loaded.append(path)

    update_weights = load


def wait_until(fn, timeout: float = 60.0, what: str = "condition"):
    """Poll ``fn`` until it returns something truthy (returned), or raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    raise TimeoutError(what)


def wait_http(url: str, child=None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise RuntimeError(f"{child.name} exited:\n{child.tail(30)}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer in {timeout}s" + (f":\n{child.tail(30)}" if child else ""))


def children_cpu() -> float:
    """CPU seconds of this process's finished children: what a `relay` command cost, unlike its wall time,
    which tests running beside it stretch."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def relay(*args: str, timeout: float = 60, cwd: Path | None = None, env: dict | None = None):
    """Run the ``relay`` command as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
        env=env or child_env(),
    )


def relay_up_args(runs_dir: Path, run_id: str, *flags: str, steps: int | None = None, sets: tuple = ()) -> list[str]:
    """``relay up``'s arguments as the integration tests give them: the run ``run_id`` under ``runs_dir``, the
    dashboard on any free port, no progress line, ``steps`` when given, the other ``flags``, and one
    ``--set`` per item of ``sets`` (``"learner.lr=0.01"``)."""
    args = ["up", "--runs-dir", str(runs_dir), "--run-id", run_id, "--dashboard-port", "0", "--no-progress"]
    if steps is not None:
        args += ["--steps", str(steps)]
    return args + list(flags) + [a for s in sets for a in ("--set", s)]


def start_broker(procs, redis_url, tmp_path, **extra):
    port, http = free_port(), free_port()
    cfg = {"run_id": "r", "redis_url": redis_url, "ingest_bind": f"tcp://127.0.0.1:{port}", "http_port": http, **extra}
    child = start_service(procs, "broker", "broker", cfg, tmp_path)
    wait_http(f"http://127.0.0.1:{http}/healthz", child)
    return f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http}"


def metric_value(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)  # with labels or without
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total
