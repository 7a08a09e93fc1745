"""Run by tests/integration/test_learner_store.py as a learner process would run: join the learner's
process group (learner/engine.py init_distributed, one rank or one of several started by
deploy/launcher/ranks.py), train nothing, and report every TCP socket that this process, or the launcher
that started it, listens on, as JSON lines in OUT (rank 0 only): {"pid", "who", "address", "port"}.

    python -m tests.support.store_listeners OUT
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from pathlib import Path

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def _address(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = struct.unpack("<4I", raw)  # /proc prints each 32-bit word in host order
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def listening(pids: dict[int, str]) -> list[dict]:
    """The TCP sockets in LISTEN state owned by ``pids`` (pid -> who)."""
    inodes = {}
    for pid, who in pids.items():
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = (pid, who)
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == LISTEN and inode in inodes:
                addr, port = local.split(":")
                pid, who = inodes[inode]
                found.append({"pid": pid, "who": who, "address": _address(addr, v6), "port": int(port, 16)})
    return found


def main() -> int:
    import torch
    import torch.distributed as dist

    from learner.engine import close_distributed, init_distributed

    launched = "WORLD_SIZE" in os.environ  # by a launcher (deploy/launcher/ranks.py); init_distributed sets it
    init_distributed()
    t = torch.ones(1)
    dist.all_reduce(t)  # the group works (gloo's links between the ranks are up)
    if dist.get_rank() == 0:
        pids = {os.getpid(): "rank 0"}
        if launched:  # its launcher's sockets count; alone, the parent is whoever ran it (a pytest worker
            pids[os.getppid()] = "launcher"  # that holds other tests' listeners)
        Path(sys.argv[1]).write_text(
            "".join(json.dumps(x) + "\n" for x in listening(pids))
            + json.dumps(
                {"world": dist.get_world_size(), "sum": t.item(), "master_port": os.environ.get("MASTER_PORT")}
            )
            + "\n"
        )
    close_distributed()  # a barrier, then the group ended on every rank
    return 0


if __name__ == "__main__":
    sys.exit(main())
