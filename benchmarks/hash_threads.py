"""weights.hash_threads measured: a version written by the learner's writer (``write_safetensors``: shards
written and hashed side by side) and verified by one generator's check (``weightstore.check``: files
read and hashed side by side), for several thread counts and version sizes. One writer or one reader
alone: what a machine with cores to spare gives (on 2 shared cores the two generators of ``relay bench
weight_sync`` already keep both busy).

    python -m benchmarks.hash_threads --out hash.json                         # 1 and 6 GiB, 1/2/4/8 threads
    python -m benchmarks.hash_threads --sizes-mb 8 --threads 1,2 --shard-mb 2  # the quick check (a test)

docs/weights.md ("Shards side by side") has the figures of a 16-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

TENSOR_MB = 64  # each tensor of the version (a layer's weight)


def measure(size_mb: int, threads: int, shard_mb: float, root: Path, state) -> dict:
    from broker.protocol import weightstore
    from learner.publish import write_safetensors

    staging = weightstore.staging_dir(root, 1)
    t0 = time.perf_counter()
    known = write_safetensors(staging, state, int(shard_mb * (1 << 20)), {"format": "pt"}, threads=threads)
    t1 = time.perf_counter()
    path, h = weightstore.seal(root, 1, staging, known)
    t2 = time.perf_counter()
    digest = weightstore.check(path, h, tensor_digest=True, threads=threads).digest
    t3 = time.perf_counter()
    shutil.rmtree(path)
    return {
        "size_mb": size_mb,
        "threads": threads,
        "shards": len(known),
        "write_s": round(t1 - t0, 4),
        "verify_s": round(t3 - t2, 4),
        "digest": digest,
    }


def main(argv: list[str] | None = None) -> dict:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="1024,6144", help="version sizes in MiB, comma-separated")
    ap.add_argument("--threads", default="1,2,4,8", help="weights.hash_threads values, comma-separated")
    ap.add_argument("--shard-mb", type=float, default=512.0, help="weights.shard_mb")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where versions are written (default: the temporary folder)")
    ap.add_argument("--out", default=None, help="JSON of every measurement")
    args = ap.parse_args(argv)
    res: dict = {"cpus": os.cpu_count(), "shard_mb": args.shard_mb, "rows": []}
    root = Path(tempfile.mkdtemp(prefix="relay-hash-", dir=args.dir))
    try:
        for size_mb in (int(x) for x in args.sizes_mb.split(",")):
            per = min(TENSOR_MB, max(1, size_mb // 8))  # at least 8 tensors
            state = {
                f"layers.{i:04d}.weight": torch.randn(per << 19, dtype=torch.float32).to(torch.bfloat16)
                for i in range(max(1, size_mb // per))
            }
            digests = set()
            for threads in (int(x) for x in args.threads.split(",")):
                for _ in range(args.repeats):
                    row = measure(size_mb, threads, args.shard_mb, root, state)
                    digests.add(row.pop("digest"))
                    print(row, flush=True)
                    res["rows"].append(row)
            # the same tensors give the same digest however many threads wrote and verified them
            assert len(digests) == 1, digests
            del state
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
