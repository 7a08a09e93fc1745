"""``relay learner --nnodes M``: this machine's part of one learner job of M nodes, launched by torchrun.

Every node runs the same command with its own ``--node-rank`` (compose: one service per node; Kubernetes:
one pod of a StatefulSet per node; ``relay up --learner-nodes M``: M processes on this machine)::

    relay learner --nnodes 2 --node-rank 0 --rdzv-endpoint learner-0:29400 --node-addr learner-0
    relay learner --nnodes 2 --node-rank 1 --rdzv-endpoint learner-0:29400 --node-addr learner-1

Each node runs torchrun's elastic agent in this process (``torch.distributed.run``: ``--nnodes M``,
``--rdzv-backend c10d`` on the endpoint, ``--max-restarts``), which starts ``--nproc-per-node`` learner
ranks (``relay learner`` with the same ``--config``/``--set``). What Relay adds, and why:

- **The rendezvous store is bound to one address.** torch's ``TCPStore`` listens on every interface
  whatever host it is given, and has no authentication: whoever reaches it can join the job or break its
  rendezvous. Node 0 hosts the store itself, on a socket bound to the endpoint's address only (default
  ``127.0.0.1``; compose and Kubernetes: the node's name on the learner nodes' own network), and every
  agent joins it as a client (``--rdzv-conf is_host=false``). With ``relay up`` the socket is bound by
  ``relay up`` and handed over (``RELAY_LISTEN_FDS``), so a restarted node 0 serves the same port.
- **So is the ranks' store.** The agents' shared store would again listen everywhere
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` turns it off); rank 0 hosts the ranks' store on the address of
  its node (``MASTER_ADDR``, the agent's ``--local-addr`` = ``--node-addr``; learner/engine.py), and
  gloo's connections stay on the interface that holds that address (``GLOO_SOCKET_IFNAME``).
- **Rank 0 is on node 0.** torchrun's c10d rendezvous numbers the nodes in the order of their
  ``--local-addr``; give node 0 the name that sorts first (``learner-0``, ``learner-1``, ...), so the leader
  (which reads the queue, commits, publishes and serves the http weights) runs where the manifests
  expect it. On one machine (``relay up``) every node is ``127.0.0.1`` and it does not matter.

Failure: a rank that dies (or a node, whose ranks' connections close) fails the collectives of every
other rank; torchrun stops the job's ranks on every node and starts them again, all together, after a
new rendezvous (at most ``--max-restarts`` times; a node that comes back joins it), and every rank
resumes from the last checkpoint (docs/deploy.md, "A learner across nodes").
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from datetime import timedelta

log = logging.getLogger("relay.learner.nodes")

DEFAULT_PORT = 29400  # torchrun's c10d default
NODES_ENV = "RELAY_LEARNER_NODES"  # set for the ranks of a node: rank 0 binds its store (learner/engine.py)
STORE_TIMEOUT = timedelta(minutes=30)  # how long a store operation may wait (torchrun's default)


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """``relay learner``'s options for a learner across nodes (none given: one process, as before)."""
    g = p.add_argument_group("a learner across nodes (torchrun; docs/deploy.md)")
    g.add_argument("--nnodes", type=int, default=None, help="nodes of the learner job (runs torchrun's agent)")
    g.add_argument("--nproc-per-node", type=int, default=1, help="learner ranks on this node (default 1)")
    g.add_argument(
        "--node-rank", type=int, default=0, help="this node's index; node 0 hosts the rendezvous (default 0)"
    )
    g.add_argument(
        "--rdzv-endpoint",
        default=f"127.0.0.1:{DEFAULT_PORT}",
        metavar="HOST:PORT",
        help="the rendezvous, on node 0 and bound to HOST's address only (default 127.0.0.1:%(default)s"
        " is the loopback: give node 0's name on the nodes' network across machines)".replace(
            "%(default)s", str(DEFAULT_PORT)
        ),
    )
    g.add_argument(
        "--node-addr",
        default="127.0.0.1",
        help="this node's name or address as the other nodes reach it: rank 0's store and gloo bind to it; "
        "ranks are numbered in the order of these names (default 127.0.0.1)",
    )
    g.add_argument("--rdzv-id", default="relay-learner", help="the job's id in the rendezvous")
    g.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="times the job's ranks are started again on every node after a failure (default 3)",
    )
    g.add_argument(
        "--join-timeout", type=int, default=600, help="seconds to wait for every node at a rendezvous (default 600)"
    )


def node_problem(args) -> str | None:
    """What is wrong with the node options, for the user (None: nothing)."""
    if args.nnodes < 1 or args.nproc_per_node < 1:
        return "--nnodes and --nproc-per-node must be at least 1"
    if not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank must be in 0..{args.nnodes - 1}"
    if args.max_restarts < 0:
        return "--max-restarts must be at least 0"
    try:
        split_endpoint(args.rdzv_endpoint)
    except ValueError as e:
        return str(e)
    return None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint must be HOST:PORT, not {endpoint!r}")
    return host.strip("[]"), int(port)


def torchrun_argv(args, worker: list[str]) -> list[str]:
    """torchrun's arguments for this node, running ``relay learner`` with ``worker`` (its config options)."""
    return [
        f"--nnodes={args.nnodes}",
        f"--nproc-per-node={args.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={args.rdzv_endpoint}",
        f"--rdzv-id={args.rdzv_id}",
        f"--rdzv-conf=is_host=false,join_timeout={args.join_timeout}",
        f"--local-addr={args.node_addr}",
        f"--max-restarts={args.max_restarts}",
        "--monitor-interval=1",
        "-m",
        "deploy.cli",
        "learner",
        *worker,
    ]


def interface_of(addr: str) -> str | None:
    """The network interface that holds ``addr``'s IPv4 address (gloo's ``GLOO_SOCKET_IFNAME``), or None."""
    import fcntl
    import struct

    try:
        ip = socket.gethostbyname(addr)
    except OSError:
        return None
    if ip.startswith("127."):
        return "lo" if os.path.isdir("/sys/class/net/lo") else None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(got[20:24]) == ip:
            return name
    return None


def host_rendezvous(host: str, port: int):
    """Node 0's rendezvous store on (``host``'s address, ``port``) only: the socket ``relay up`` handed over,
    else one bound here."""
    from torch.distributed import TCPStore

    from broker.runtime.ports import handed_over_fd

    fd = handed_over_fd(host, port)
    if fd is None:
        try:
            sock = socket.create_server((socket.gethostbyname(host), port), backlog=128)
        except OSError as e:
            raise SystemExit(
                f"relay learner: node 0 cannot host the rendezvous on {host}:{port} ({e.strerror or e}); "
                f"--rdzv-endpoint must name an address of node 0 and a free port"
            ) from None
        fd = sock.detach()  # the store owns the listening socket from here on
    else:
        fd = os.dup(fd)
    return TCPStore(host, port, None, True, STORE_TIMEOUT, wait_for_workers=False, master_listen_fd=fd)


def run_node(args, worker: list[str]) -> int:
    """Run this node's agent until the job ends: 0 when every rank finished, 1 when it failed for good."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    from broker.runtime.ports import LISTEN_FDS

    host, port = split_endpoint(args.rdzv_endpoint)
    store = host_rendezvous(host, port) if args.node_rank == 0 else None
    os.environ.pop(LISTEN_FDS, None)  # the ranks are handed nothing
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # no store of the agents' on every interface
    os.environ[NODES_ENV] = "1"
    if "GLOO_SOCKET_IFNAME" not in os.environ and (ifname := interface_of(args.node_addr)):
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    print(
        f"relay learner: node {args.node_rank} of {args.nnodes} ({args.node_addr}, {args.nproc_per_node} rank(s)), "
        f"rendezvous {args.rdzv_endpoint}{' hosted here' if store is not None else ''}, gloo on "
        f"{os.environ.get('GLOO_SOCKET_IFNAME', 'the default interface')}",
        file=sys.stderr,
        flush=True,
    )
    try:
        run(get_args_parser().parse_args(torchrun_argv(args, worker)))
    except (ChildFailedError, RendezvousError) as e:
        print(f"relay learner: node {args.node_rank}: the job failed: {e}", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:  # SIGTERM/SIGINT: the ranks were stopped (each checkpoints on SIGTERM)
        print(f"relay learner: node {args.node_rank}: stopped by {e.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    finally:
        del store
    return 0


def worker_args(args) -> list[str]:
    """The learner's own options (config file, overrides, logging), as each rank gets them."""
    out = ["--config", args.config] if args.config else []
    for s in args.set:
        out += ["--set", s]
    return out + (["--log-json"] if args.log_json else [])
