"""``relay up --learner-ranks N``: the learner's N processes on this machine, and their rendezvous store on
127.0.0.1 only.

``torchrun --standalone`` (what ``relay up`` used) hosts its store, the torch ``TCPStore`` every rank
joins through ``env://``, on a port the kernel picks and on every interface (``[::]``), whatever host it
is told. Here the launcher binds a socket on 127.0.0.1 itself, hosts the store on that socket
(``TCPStore(master_listen_fd=...)``), and starts the ranks as torchrun starts its workers: ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (the store) and
``TORCHELASTIC_USE_AGENT_STORE`` (every rank joins the launcher's store; none hosts one). The port is
held from the moment it is chosen, so no other process can take it before the ranks join.

The ranks are watched as torchrun watches its workers, without restarts of its own (``relay up``'s
supervisor restarts the whole learner): they share this process's group, so ``relay up``'s SIGTERM
reaches each of them (each finishes its step and checkpoints); when one rank exits with an error, the
others get SIGTERM, then SIGKILL after :data:`GRACE_S`, and the launcher exits with that rank's code; it
exits 0 when every rank did. Each rank dies with the launcher (PR_SET_PDEATHSIG).

    python -m deploy.launcher.ranks N COMMAND...    (e.g. N = 2, COMMAND = python -m deploy.cli learner ...)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

from deploy.launcher.procs import _die_with_parent

HOST = "127.0.0.1"
GRACE_S = 60.0  # a rank still running this long after its peers were told to stop is killed
STORE_TIMEOUT = timedelta(minutes=30)  # how long a store operation may wait (torchrun's default)


def rank_env(environ: dict, rank: int, world: int, port: int) -> dict:
    """The environment of rank ``rank`` of ``world``, joining the store at 127.0.0.1:``port``. Gloo's
    connections between the ranks (each rank listens for its peers) stay on the loopback interface too,
    unless ``GLOO_SOCKET_IFNAME`` says otherwise."""
    if "GLOO_SOCKET_IFNAME" not in environ and os.path.isdir("/sys/class/net/lo"):
        environ = {**environ, "GLOO_SOCKET_IFNAME": "lo"}
    return {
        **environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def host_store(world: int):
    """The ranks' store, hosted here on a socket bound to 127.0.0.1 (the port: ``store.port``)."""
    from torch.distributed import TCPStore

    sock = socket.create_server((HOST, 0), backlog=128)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the listening socket from here on
    return TCPStore(HOST, port, world, True, STORE_TIMEOUT, wait_for_workers=False, master_listen_fd=fd)


def run(world: int, command: list[str]) -> int:
    store = host_store(world)
    stopping = {"sig": None}

    def forward(signum, _frame):
        stopping["sig"] = signum
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signum)

    ranks: list[subprocess.Popen] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    for rank in range(world):
        ranks.append(
            subprocess.Popen(
                command, env=rank_env(dict(os.environ), rank, world, store.port), preexec_fn=_die_with_parent
            )
        )
    failed = None
    while None in [p.poll() for p in ranks]:  # every rank polled (any() would stop at the first running one)
        bad = [(i, p.returncode) for i, p in enumerate(ranks) if p.returncode not in (None, 0)]
        if bad and failed is None:
            failed = bad[0]
            print(
                f"relay learner ranks: rank {failed[0]} exited with code {failed[1]}; stopping the other ranks",
                file=sys.stderr,
                flush=True,
            )
            for p in ranks:
                if p.poll() is None:
                    p.terminate()
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and any(p.poll() is None for p in ranks):
                time.sleep(0.2)
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.2)
    codes = [p.wait() for p in ranks]
    if failed is None:
        failed = next(((i, c) for i, c in enumerate(codes) if c != 0), None)
    del store
    return 0 if failed is None else (failed[1] if failed[1] > 0 else 128 - failed[1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python -m deploy.launcher.ranks N COMMAND...", file=sys.stderr)
        return 2
    return run(int(argv[0]), argv[1:])


if __name__ == "__main__":
    sys.exit(main())
