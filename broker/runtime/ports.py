"""TCP ports for the services a launcher starts: bound by the launcher and handed over, or chosen free.

A port found free now and bound by its service only later (after Redis starts, after a process
imports torch) can be taken in between: by another launcher that picked the same one (a ``relay up``
beside another run died with ``EADDRINUSE``), or, for a port of the kernel's ephemeral range, by any
outgoing connection on the machine. So:

- :func:`hold_port` binds and listens at once, and keeps the socket: the port is the launcher's from
  the moment it is chosen. The launcher hands the socket to the service it starts (``pass_fds``, its
  numbers in the ``RELAY_LISTEN_FDS`` environment variable), and the service serves on it
  (:func:`handed_over`) instead of binding the port again; a service restarted by the launcher gets the
  same socket again, so its port never changes while the run lasts. Ports are drawn at random from
  outside ``/proc/sys/net/ipv4/ip_local_port_range``, where no outgoing connection takes them.
- :func:`free_port` (a port free now, not held) remains for what cannot take a socket (redis-server,
  which ``relay up`` starts again on another port when its port was taken meanwhile) and for tests.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import random
import socket
from pathlib import Path

LISTEN_FDS = "RELAY_LISTEN_FDS"  # the listening sockets a launcher handed to a service: their fds, comma-separated

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


def _listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on (host, port) now (no SO_REUSEPORT: a port someone holds is refused)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host.strip("[]"), port), family=family, backlog=128)


def hold_port(host: str = "127.0.0.1", port: int = 0, tries: int = 200) -> socket.socket:
    """A socket bound and listening on ``host``: on ``port``, or with 0 on a port drawn outside the
    ephemeral range (the kernel's pick when there is no room there). OSError when ``port`` is taken."""
    if port:
        return _listener(host, port)
    spans = _candidates()
    weights = [len(s) for s in spans]
    for _ in range(tries if spans else 0):
        try:
            return _listener(host, _rng.choice(_rng.choices(spans, weights)[0]))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
    return _listener(host, 0)


def hold_port_run(n: int, host: str = "127.0.0.1", tries: int = 50) -> list[socket.socket]:
    """``n`` sockets held on consecutive ports (a broker's ingest workers: port + k each)."""
    for _ in range(tries):
        first = hold_port(host)
        held = [first]
        base = first.getsockname()[1]
        try:
            if base + n - 1 > 65535:
                raise OSError(errno.EADDRINUSE, "past the last port")
            held += [_listener(host, base + k) for k in range(1, n)]
            return held
        except OSError:
            for s in held:
                s.close()
    raise OSError(f"no {n} consecutive free ports found on {host}")


def _addresses(host: str) -> set[str]:
    """The IP addresses ``host`` names (a wildcard as the family's any-address)."""
    if host in ("", "*"):
        return {"0.0.0.0"}
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()


def handed_over_fd(host: str, port: int, environ=None) -> int | None:
    """The fd of the listening socket on (``host``, ``port``) that this process's launcher handed over
    (``RELAY_LISTEN_FDS``), or None: the service then binds the port itself. The fd stays open and this
    process's own; use it through a duplicate (:func:`handed_over`), and pass it on to a child of its own
    (a broker's ingest worker) the same way."""
    environ = os.environ if environ is None else environ
    wanted = _addresses(host)
    for token in environ.get(LISTEN_FDS, "").split(","):
        if not token.strip().isdigit():
            continue
        fd = int(token)
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.type != socket.SOCK_STREAM:
                    continue
                bound = s.getsockname()
        except OSError:  # closed, or not a socket
            continue
        if bound[1] == port and str(ipaddress.ip_address(bound[0])) in wanted:
            return fd
    return None


def handed_over(host: str, port: int) -> socket.socket | None:
    """The listening socket on (``host``, ``port``) handed over by the launcher, as a socket object of
    its own (a duplicate of the fd), or None."""
    fd = handed_over_fd(host, port)
    return socket.socket(fileno=os.dup(fd)) if fd is not None else None


def tcp_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a ZeroMQ ``tcp://HOST:PORT`` address (``*`` is every interface), else None."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://") :].rstrip("/").rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def handed_over_bind(address: str) -> int | None:
    """The fd handed over for the ZeroMQ bind ``address`` (:func:`handed_over_fd`), or None."""
    hp = tcp_host_port(address)
    return handed_over_fd(*hp) if hp is not None and hp[1] else None
