"""The ``ipc`` weight transport (learner/ipc.py -> generators/ipc_receive.py; issue 18's CUDA IPC item)
measured on a ~0.5B model in bf16: a learner process hands each version to a torch-backend generator
process on the same GPU, against a raw device-to-device copy of the same bytes. A prepared script for a
lent GPU machine (docs/benchmarks.md); it also runs on CPU at a tiny size, where the slots are POSIX
shared memory instead, which is how it is tested.

    python -m benchmarks.gpu_ipc --out ipc.json                           # CUDA, ~0.5B, bf16
    python -m benchmarks.gpu_ipc --device cpu --size tiny --out t.json    # the CPU check (seconds)

What it does: a redis-server of its own (benchmarks/common.py ``Stack``) and the run's announcement key;
the "learner" (this process) loads a random-init model of Qwen2.5-0.5B's shape (``benchmarks.gpu_learner``;
``--size tiny``: the built-in tiny model) in bf16 on the device, with the transport's ``IpcSharer``. The
"generator" (a child process) runs the generators' ``torch`` backend on the same device with an
``IpcReceiver`` and a ``WeightApplier``, as ``relay generator`` does, calling ``update()`` in a loop. Each
round the learner changes its weights (a new version) and publishes it as the learner does:
``stage`` (the copy into a slot on the device, in the learner's thread), the pinned host snapshot the
store copy is written from (learner/publish.py ``fill``), then ``send`` (in the publisher's thread: the
finiteness check and the digest of the slot, the signed ``current``). The generator copies the slot
device to device as soon as ``staged`` names it, checks the sequence number and digests its copy (beside
the learner's digest), compares it with the signed digest once ``current`` appears and applies it (the
torch backend adopts the copy); it prints when. ``generator_receive_s``: from the start of its copy to the
version ready (the copy, its digest, then the wait for ``current``). The round's latency runs from the start
of ``stage`` to that moment; the raw baseline, timed alternately, is one device-to-device copy of the
same bytes. ``digest_match``: the digest announced equals the digest of the snapshot (what the store copy
carries) and the digest of what the generator serves, every version.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.gpu_learner import SIZES, build_model

RUN = "bench-ipc"


def generator(device: str, model_dir: str, redis_url: str, key_file: str) -> None:
    """The child: a torch-backend generator following the ipc transport; one JSON line per version applied."""
    from broker.client.connection import connect_redis
    from broker.protocol.keys import Keys
    from broker.protocol.signing import read_verifier
    from broker.protocol.tensordigest import state_digest
    from generators.config import TorchBackendConfig
    from generators.ipc_receive import IpcReceiver
    from generators.weights import WeightApplier

    r, keys, key = connect_redis(redis_url), Keys(RUN), read_verifier(key_file)
    backend = TorchBackendConfig(device=device, dtype="bfloat16").build()
    backend.load(model_dir)
    receiver = IpcReceiver(r, keys, "g-0", key, device=device)
    w = WeightApplier(r, keys, backend, "g-0", announce_key=key, receiver=receiver)
    w.version = 0  # the initial weights, as if loaded from the store
    receiver.start()
    print(json.dumps({"ready": True}), flush=True)
    done = threading.Event()  # the learner closed the pipe
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    served = 0
    while not done.is_set():
        w.update()
        if w.version != served:
            now = time.time()
            served = w.version
            t0 = time.perf_counter()
            engine = {
                k: v
                for k, v in backend.model.state_dict().items()
                if k != "lm_head.weight" or not backend.model.config.tie_word_embeddings
            }
            print(
                json.dumps(
                    {
                        "version": served,
                        "t": now,
                        "digest": w.digest,
                        "via": w.via,
                        "refused": w.refused_updates,
                        "receive_s": w.last_receive_s,
                        "engine_digest": state_digest(engine),
                        "engine_digest_s": time.perf_counter() - t0,
                    }
                ),
                flush=True,
            )
        if w.refused_updates:
            break
        time.sleep(0.001)
    receiver.close()


def main(device: str, size_name: str, rounds: int, out: Path | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.common import Stack
    from broker.client.connection import connect_redis
    from broker.protocol.keys import Keys
    from broker.protocol.tensordigest import state_digest
    from learner.ipc import IpcSharer
    from learner.publish import fill, refuse_nonfinite, snapshot_buffers

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="relay-gpu-ipc-") as tmp, Stack(Path(tmp) / "stack") as stack:
        redis_url = stack.redis()
        r, keys = connect_redis(redis_url), Keys(RUN)
        model_dir = build_model(Path(tmp) / "model", SIZES[size_name]["model"])
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
        tied = bool(model.config.tie_word_embeddings)
        weights = model.state_dict()  # what the learner publishes (full_state_dict): the tied head under both names
        params = dict(model.named_parameters())
        sharer = IpcSharer(r, keys, stack.announce_key).start()
        snap = snapshot_buffers(weights, torch.bfloat16, tied)
        nbytes = sum(t.numel() * t.element_size() for t in snap.values())
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.gpu_ipc",
                "--generator",
                device,
                str(model_dir),
                redis_url,
                stack.announce_public_key_file,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            text=True,
        )
        try:
            if not json.loads(child.stdout.readline() or "{}").get("ready"):
                raise RuntimeError(f"the generator process exited with {child.wait()}")
            rows = []
            g = torch.Generator(device=device).manual_seed(0)
            names = list(params)
            for version in range(1, rounds + 2):  # the first is a warm-up (the slots are allocated then)
                with torch.no_grad():  # a new version: one tensor redrawn, as a step changes every tensor
                    p = params[names[version % len(names)]]
                    p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=p.dtype))
                sync()
                t_start, t0 = time.time(), time.perf_counter()
                sharer.stage(version, weights, torch.bfloat16, tied)
                t_stage = time.perf_counter() - t0
                fill(snap, weights)  # the host snapshot the store copy is written from
                t_blocked = time.perf_counter() - t0
                t1 = time.perf_counter()
                digest = sharer.send(version, snap, check=lambda: refuse_nonfinite(snap, version))
                t_send = time.perf_counter() - t1
                line = child.stdout.readline()
                if not line:
                    raise RuntimeError(f"the generator process exited with {child.wait()}")
                ans = json.loads(line)
                slot = sharer.slots[0][: sharer.layout.total]
                raw_dst = torch.empty_like(slot)
                sync()
                t1 = time.perf_counter()
                raw_dst.copy_(slot)
                sync()
                t_raw = time.perf_counter() - t1
                rows.append(
                    {
                        "version": version,
                        "latency_s": ans["t"] - t_start,
                        "raw_copy_s": t_raw,
                        "stage_s": t_stage,
                        "learner_blocked_s": t_blocked,
                        "send_s": t_send,
                        "generator_receive_s": ans["receive_s"],
                        "match": ans["version"] == version
                        and ans["via"] == "ipc"
                        and not ans["refused"]
                        and ans["digest"] == digest == state_digest(snap) == ans["engine_digest"],
                    }
                )
        finally:
            child.stdin.close()
            if child.wait(60) != 0:
                raise RuntimeError(f"the generator process exited with {child.returncode}")
            sharer.close()
    timed = rows[1:]
    med = statistics.median

    def col(k):
        return [x[k] for x in timed]

    result = {
        "device": device if not cuda else torch.cuda.get_device_name(device),
        "size": size_name,
        "params": nbytes // 2,
        "bytes": nbytes,
        "rounds": rounds,
        "transport": "cuda-ipc" if cuda else "shm",
        "latency_s": med(col("latency_s")),
        "latency_s_all": col("latency_s"),
        "raw_copy_s": med(col("raw_copy_s")),
        "raw_copy_s_all": col("raw_copy_s"),
        "ratio": med(col("latency_s")) / med(col("raw_copy_s")),
        "stage_s": med(col("stage_s")),
        "learner_blocked_s": med(col("learner_blocked_s")),
        "send_s": med(col("send_s")),
        "generator_receive_s": med(col("generator_receive_s")),
        "raw_GB_per_s": nbytes / med(col("raw_copy_s")) / 1e9,
        "digest_match": all(x["match"] for x in rows),
        "rows": rows,
    }
    if out:
        Path(out).write_text(json.dumps(result, indent=1, allow_nan=False))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    p.add_argument("--rounds", type=int, default=5, help="timed versions (after one warm-up)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument(
        "--generator", nargs=4, metavar=("DEVICE", "MODEL_DIR", "REDIS_URL", "KEY_FILE"), help=argparse.SUPPRESS
    )
    a = p.parse_args()
    if a.generator:
        generator(*a.generator)
    else:
        main(a.device, a.size, a.rounds, a.out)
