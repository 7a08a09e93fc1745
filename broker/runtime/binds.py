"""Where a listener without authentication may bind: loopback only, unless the operator says otherwise.

Each listener that has an authentication setting (the broker's ingest: ``ingest_auth``; the reward
service: ``auth_token``; the learner's weight server: the token derived from the announcement key) refuses,
at config validation, to bind an address other hosts can reach while that setting is off, unless the
service's ``allow_unauthenticated_bind`` is true. The error names the setting and the ways out
(docs/security.md, "Listeners"). A name other than ``localhost`` is not resolved: it counts as reachable.
"""

from __future__ import annotations

import ipaddress

ALLOW_FIELD = "allow_unauthenticated_bind"
ALLOW_DESCRIPTION = (
    "accept binding an address other hosts can reach while this service's listener has its "
    "authentication off (otherwise refused at start-up, naming the setting; docs/security.md)"
)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address, ``localhost``, or a bracketed IPv6 address) is a loopback address."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:  # a wildcard (*, 0.0.0.0 parses and is not loopback), a host name, an interface name
        return False


def zmq_bind_host(address: str) -> str | None:
    """The host of a ZeroMQ ``tcp://host:port`` bind address; None for transports no other host reaches
    (``ipc://``, ``inproc://``)."""
    scheme, _, rest = address.partition("://")
    if scheme not in ("tcp", "ws", "wss", "udp", "pgm", "epgm", "tipc", "vmci"):
        return None
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.split(";")[-1]  # tcp://source;host:port binds host


def refuse_open_bind(setting: str, address: str, host: str | None, why: str, fix: str, allowed: bool) -> None:
    """ValueError when ``host`` is reachable from other hosts (not loopback, not None) and not ``allowed``."""
    if allowed or host is None or is_loopback(host):
        return
    raise ValueError(
        f"{setting} = {address!r} is reachable from other hosts, but {why}: {fix}, bind 127.0.0.1, or "
        f'set {ALLOW_FIELD} = true to accept it (docs/security.md, "Listeners")'
    )
