"""Weights handed from a learner process to a generator process on the same GPU through CUDA IPC
(issue 18's ``ipc`` item), against a raw device-to-device copy of the same bytes. A prepared script
for a lent GPU machine (docs/benchmarks.md); it also runs on CPU at a tiny size, through POSIX shared
memory instead, which is how it is tested.

    python -m benchmarks.gpu_ipc --out ipc.json                           # CUDA, ~0.5B, bf16
    python -m benchmarks.gpu_ipc --device cpu --size tiny --out t.json    # the CPU check (seconds)

What it does: the "learner" (this process) loads a random-init model of Qwen2.5-0.5B's shape (the
one ``benchmarks.gpu_learner`` builds; ``--size tiny``: the built-in tiny model) in bf16 on the
device and keeps one flat staging buffer of all its parameters there. It exports that buffer's
memory once, as plain fields (CUDA: the allocation's IPC handle with its offsets, reference counter
and event, ``UntypedStorage._share_cuda_``; CPU: a shared-memory segment's name), msgpack-encoded
over a pipe: no pickle. The "generator" (a child process running the generators' ``torch`` backend
on the same device) maps the buffer once. Each round the learner changes its weights (a new
version), copies them into the buffer (the snapshot), synchronises and sends the version's layout;
the generator copies the tensors from the mapped buffer into its model's parameters
(``update_weights_from_tensors``: device to device), synchronises and answers. The round's latency
runs from the start of the snapshot to the answer. The raw baseline, timed alternately in the
learner, is one device-to-device copy of the same bytes. The generator's XXH3 digest of the weights
it now serves (``tensordigest.state_digest``, what every transport checks against the announced
one; on a GPU streamed to the host in pinned chunks, ``tensordigest.device_entries``) is part of the
latency, timed on its own too (``latency_without_digest_s`` leaves it out) and compared with the
learner's: ``digest_match`` must be true.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack

from benchmarks.gpu_learner import SIZES, build_model


def _send(stream, obj: dict) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _recv(stream) -> dict:
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError("the learner closed the pipe")
    (n,) = struct.unpack(">I", head)
    return msgpack.unpackb(stream.read(n), raw=False)


def export_buffer(flat) -> dict:
    """The fields another process needs to map ``flat`` (a 1-D tensor that owns its whole storage):
    plain numbers and bytes, never a pickled object."""
    if flat.device.type == "cuda":
        (device, handle, size, offset, ref_handle, ref_offset, event_handle,
         event_sync) = flat.untyped_storage()._share_cuda_()
        return {"kind": "cuda", "device": device, "handle": handle, "size": size, "offset": offset,
                "ref_handle": ref_handle, "ref_offset": ref_offset, "event_handle": event_handle,
                "event_sync": event_sync, "numel": flat.numel()}
    return {"kind": "shm", "name": flat._relay_shm.name, "numel": flat.numel()}


def open_buffer(h: dict):
    """The tensor ``export_buffer`` described, mapped in this process (bf16, 1-D), and what must stay alive."""
    import torch

    if h["kind"] == "cuda":
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(h["device"], h["handle"], h["size"], h["offset"],
                                                        h["ref_handle"], h["ref_offset"], h["event_handle"],
                                                        h["event_sync"])
        flat = torch.empty(0, dtype=torch.bfloat16, device=f"cuda:{h['device']}")
        flat.set_(storage, 0, (h["numel"],), (1,))
        return flat, storage
    from multiprocessing import resource_tracker, shared_memory

    shm = shared_memory.SharedMemory(name=h["name"])
    resource_tracker.unregister(shm._name, "shared_memory")  # the learner owns (and unlinks) the segment
    return torch.frombuffer(shm.buf, dtype=torch.bfloat16, count=h["numel"]), shm


def staging_buffer(numel: int, device: str):
    """The learner's flat bf16 buffer: CUDA memory, or (on CPU) a shared-memory segment."""
    import torch

    if device.startswith("cuda"):
        return torch.empty(numel, dtype=torch.bfloat16, device=device)
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=2 * numel)
    flat = torch.frombuffer(shm.buf, dtype=torch.bfloat16, count=numel)
    flat._relay_shm = shm
    return flat


def generator(device: str, model_dir: str) -> None:
    """The child: a torch-backend generator that maps the learner's buffer and applies each version."""
    import torch

    from broker.protocol import tensordigest
    from generators.config import TorchBackendConfig

    backend = TorchBackendConfig(device=device, dtype="bfloat16").build()
    backend.load(model_dir)
    inp, out = sys.stdin.buffer, sys.stdout
    handle = _recv(inp)
    t0 = time.perf_counter()  # the mapping alone, not the wait for the learner's message
    flat, keep = open_buffer(handle)
    print(json.dumps({"opened_s": time.perf_counter() - t0}), file=out, flush=True)
    while True:
        try:
            msg = _recv(inp)
        except EOFError:
            break
        t0 = time.perf_counter()
        views = {name: flat[off:off + n].view(shape) for name, off, n, shape in msg["layout"]}
        backend.update_weights_from_tensors(views)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        applied = time.perf_counter() - t0
        t0 = time.perf_counter()
        served = {k: v for k, v in backend.model.state_dict().items() if k in views}
        digest = tensordigest.state_digest(served)
        print(json.dumps({"version": msg["version"], "apply_s": applied, "digest_s": time.perf_counter() - t0,
                          "digest": digest}), file=out, flush=True)
    del keep


def main(device: str, size_name: str, rounds: int, out: Path | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from broker.protocol import tensordigest

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="relay-gpu-ipc-") as tmp:
        model_dir = build_model(Path(tmp) / "model", SIZES[size_name]["model"])
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
        params = dict(model.named_parameters())  # a tied head once, under the embedding's name
        layout, off = [], 0
        for name, p in params.items():
            layout.append([name, off, p.numel(), list(p.shape)])
            off += p.numel()
        flat = staging_buffer(off, device)
        raw_dst = torch.empty_like(flat)
        child = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_ipc", "--generator", device, str(model_dir)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"), text=False)
        try:
            _send(child.stdin, export_buffer(flat))
            opened = json.loads(child.stdout.readline())
            lat, bare, raw, snap, applies, digests, matches = [], [], [], [], [], [], []
            g = torch.Generator(device=device).manual_seed(0)
            for version in range(1, rounds + 2):  # the first is a warm-up
                with torch.no_grad():  # a new version: one tensor redrawn, as a step changes every tensor
                    p = params[layout[version % len(layout)][0]]
                    p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=p.dtype))
                sync()
                t0 = time.perf_counter()
                with torch.no_grad():
                    for name, o, n, _ in layout:
                        flat[o:o + n].copy_(params[name].reshape(-1))
                sync()
                t_snap = time.perf_counter() - t0
                _send(child.stdin, {"version": version, "layout": layout})
                line = child.stdout.readline()
                t_all = time.perf_counter() - t0
                if not line:
                    raise RuntimeError(f"the generator process exited with {child.wait()}")
                ans = json.loads(line)
                sync()
                t1 = time.perf_counter()
                raw_dst.copy_(flat)
                sync()
                t_raw = time.perf_counter() - t1
                want = tensordigest.state_digest({name: params[name] for name, *_ in layout})
                matches.append(ans["digest"] == want and ans["version"] == version)
                if version > 1:
                    lat.append(t_all)
                    bare.append(t_all - ans["digest_s"])
                    raw.append(t_raw)
                    snap.append(t_snap)
                    applies.append(ans["apply_s"])
                    digests.append(ans["digest_s"])
        finally:
            if child.stdin:
                child.stdin.close()
            if child.wait(60) != 0:
                raise RuntimeError(f"the generator process exited with {child.returncode}")
            if not cuda:
                flat._relay_shm.close()
                flat._relay_shm.unlink()
    nbytes = 2 * off
    med = statistics.median
    result = {"device": device if not cuda else torch.cuda.get_device_name(device), "size": size_name,
              "params": off, "bytes": nbytes, "rounds": rounds, "transport": "cuda-ipc" if cuda else "shm",
              "opened_s": opened["opened_s"], "latency_s": med(lat), "latency_s_all": lat, "raw_copy_s": med(raw),
              "raw_copy_s_all": raw, "ratio": med(lat) / med(raw), "snapshot_s": med(snap),
              "latency_without_digest_s": med(bare), "ratio_without_digest": med(bare) / med(raw),
              "apply_s": med(applies), "digest_s": med(digests), "digest_GB_per_s": nbytes / med(digests) / 1e9,
              "raw_GB_per_s": nbytes / med(raw) / 1e9,
              "digest_match": all(matches)}
    if out:
        Path(out).write_text(json.dumps(result, indent=1, allow_nan=False))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    p.add_argument("--rounds", type=int, default=5, help="timed versions (after one warm-up)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--generator", nargs=2, metavar=("DEVICE", "MODEL_DIR"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.generator:
        generator(*a.generator)
    else:
        main(a.device, a.size, a.rounds, a.out)
