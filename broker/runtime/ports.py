"""Free TCP ports for the services a launcher starts, chosen outside the kernel's ephemeral range.

A port found free now is bound by its service only later (after Redis starts, after a process
imports torch). Asking the kernel for one (``bind(("127.0.0.1", 0))``) returns a port of its
ephemeral range, the range every outgoing connection on the machine also draws its local port
from: in that window any process's HTTP request or Redis connection can take it, and the service
then fails with "Address already in use" for as long as that connection lives. (A broker of the
test suite did, ten restarts in a row, with another test's connections running beside it.)
So the ports here are drawn at random from outside ``/proc/sys/net/ipv4/ip_local_port_range``,
where no connection takes them; only another launcher picking the same one in the same second
could, one chance in thousands.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Linux's default ephemeral range, used where /proc does not say
DEFAULT_EPHEMERAL = (32768, 60999)
# drawn from [LOWEST, 65535] minus the ephemeral range: clear of the well-known and common dev ports
LOWEST = 20000
_rng = random.SystemRandom()  # not the random module's state, which a forked child shares


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (first, last)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):  # not Linux, or an unreadable /proc
        return DEFAULT_EPHEMERAL
    return lo, hi


def _candidates() -> list[range]:
    lo, hi = ephemeral_range()
    spans = [range(LOWEST, min(lo, 65536)), range(max(hi + 1, LOWEST), 65536)]
    return [s for s in spans if len(s)]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port free now on ``host``, outside the ephemeral range where there is room (else the kernel's)."""
    spans = _candidates()
    weights = [len(s) for s in spans]
    for _ in range(tries if spans else 0):
        port = _rng.choice(_rng.choices(spans, weights)[0])
        if not port_in_use(port, host):
            return port
    with socket.socket() as s:  # no room outside the ephemeral range (or all taken): the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_run(n: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """The first of ``n`` consecutive free ports (a broker's ingest workers: port + k each)."""
    for _ in range(tries):
        base = free_port(host)
        if base + n - 1 <= 65535 and not any(port_in_use(base + k, host) for k in range(1, n)):
            return base
    raise OSError(f"no {n} consecutive free ports found on {host}")
