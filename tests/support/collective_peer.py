"""A generator's side of an in-process weight transport, alone in its process: the collective (tests of
learner/broadcast.py + generators/weight_receive.py over real gloo groups) or, with ``--transport ipc``,
shared memory (learner/ipc.py + generators/ipc_receive.py): a torch backend loaded from a model folder,
a WeightApplier with a real receiver. It applies what arrives until it serves
``--until`` (or refused ``--until-refused`` versions), then prints one JSON line: what it serves, what
it refused, and a checksum of the engine's weights as they are.

``--flip-bucket I`` flips one byte of bucket I of the first version received (a faulty link; with
``--transport ipc``, of the first version's copy, ``I`` ignored). ``--device cuda`` runs the engine there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from broker.client.connection import connect_redis
from broker.protocol.keys import Keys
from broker.protocol import weightauth
from broker.protocol.signing import read_verifier
from broker.protocol.tensordigest import state_digest
from broker.protocol.weights_config import CollectiveTransport
from generators.config import TorchBackendConfig
from generators.ipc_receive import IpcReceiver
from generators.weight_receive import Receiver
from generators.weights import WeightApplier


def main() -> None:
    p = argparse.ArgumentParser()
    for a in ("--redis", "--run", "--key-file", "--model", "--id"):  # --key-file: the public announcement key
        p.add_argument(a, required=True)
    p.add_argument("--weights-key-file", default="", help="the run's weights key (collective joins)")
    p.add_argument("--until", type=int, default=1)
    p.add_argument("--until-refused", type=int, default=0)
    p.add_argument("--flip-bucket", type=int, default=-1)
    p.add_argument("--bucket-mb", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--transport", choices=("collective", "ipc"), default="collective")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    r, keys = connect_redis(args.redis), Keys(args.run)
    key = read_verifier(args.key_file)
    wkey = weightauth.read_key_file(args.weights_key_file) if args.weights_key_file else None
    flipped = []

    def flip(i: int, bucket: torch.Tensor) -> None:
        if i == args.flip_bucket and not flipped:
            bucket[bucket.numel() // 2] ^= 0x40
            flipped.append(i)

    backend = TorchBackendConfig(device=args.device).build()
    backend.load(args.model)
    if args.transport == "ipc":

        def flip_copy(flat: torch.Tensor) -> None:  # a byte in the middle of the largest tensor
            if not flipped:
                s = max(receiver.slots.layout.slots, key=lambda s: s.nbytes)
                flat[s.offset + s.nbytes // 2] ^= 0x40
                flipped.append(0)

        receiver = IpcReceiver(
            r, keys, args.id, key, device=args.device, tamper=flip_copy if args.flip_bucket >= 0 else None
        )
    else:
        receiver = Receiver(
            r,
            keys,
            CollectiveTransport(bucket_mb=args.bucket_mb, timeout_s=args.timeout),
            args.id,
            key,
            wkey,
            tamper=flip if args.flip_bucket >= 0 else None,
        )
    w = WeightApplier(r, keys, backend, args.id, announce_key=key, receiver=receiver)
    w.version = 0  # the initial weights, as if loaded from the store
    receiver.start()
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        w.update()
        if w.version >= args.until and w.refused_updates >= args.until_refused:
            break
        time.sleep(0.02)
    state = {k: v for k, v in backend.model.state_dict().items() if k != "lm_head.weight"}
    t0 = time.monotonic()
    receiver.close()  # leaves the group: its thread must end before the process exits
    print(
        json.dumps(
            {
                "version": w.version,
                "via": w.via,
                "digest": w.digest,
                "refused_updates": w.refused_updates,
                "refused": w.refused,
                "collective_updates": w.collective_updates,
                "flipped": flipped,
                "engine_digest": state_digest(state),
                "joins": receiver.joins,
                "left_s": round(time.monotonic() - t0, 3),
                "thread_ended": not receiver.running(),
            }
        ),
        flush=True,
    )
    sys.exit(0)


if __name__ == "__main__":
    main()
