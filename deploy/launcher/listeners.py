"""The ports ``relay up`` gives its services, bound by ``relay up`` itself from the moment they are chosen
until the run ends, and handed to each service as a listening socket (broker/runtime/ports.py).

Before, a port was picked free, closed, and bound by its service seconds later (after Redis started,
after the service imported its packages): a ``relay up`` started beside another run could pick the same
port in between, and one of the two died with ``EADDRINUSE``. Now the broker's HTTP port and ingest
address(es) and the reward service's port are bound here, before anything starts; a port that is taken
is replaced by a free one in every config that names it when ``relay up`` chose it (or a resumed run
recorded it), and is an error naming the setting when the user set it. A service restarted during the
run gets the same socket again, so its port never moves while the run lasts.

Not here: the embedded Redis (redis-server cannot take a socket: ``relay up`` starts it on another port
when its port was taken meanwhile, deploy/launcher/procs.py), the learner (one rank listens on nothing;
several reach each other through a store on 127.0.0.1 that their launcher holds, deploy/launcher/ranks.py),
and the servers that bind port 0 themselves and advertise the port they got (the learner's /metrics and
weight server).
"""

from __future__ import annotations

import os
import socket

from broker.runtime.ports import LISTEN_FDS, hold_port, hold_port_run, tcp_host_port


class PortTaken(Exception):
    """A port the user set is taken; the message names the setting."""


class Listeners:
    """The listening sockets held for each service of a run."""

    def __init__(self):
        self.sockets: dict[str, list[socket.socket]] = {}

    def add(self, service: str, *socks: socket.socket) -> None:
        self.sockets.setdefault(service, []).extend(socks)

    def fds(self, service: str) -> tuple[int, ...]:
        return tuple(s.fileno() for s in self.sockets.get(service, []))

    def env(self, service: str) -> dict[str, str]:
        """The service's environment entry naming its sockets (none without)."""
        fds = self.fds(service)
        return {LISTEN_FDS: ",".join(map(str, fds))} if fds else {}

    def close(self) -> None:
        for socks in self.sockets.values():
            for s in socks:
                s.close()
        self.sockets.clear()


def _bind_host(host: str) -> str:
    return "0.0.0.0" if host in ("", "*") else host


def _why(e: OSError) -> str:
    return os.strerror(e.errno) if e.errno and e.errno > 0 else str(e)


def _hold(host: str, port: int, movable: bool, setting: str) -> socket.socket:
    try:
        return hold_port(_bind_host(host), port)
    except OSError as e:
        if not movable:
            raise PortTaken(
                f"cannot listen on {host}:{port} ({setting}): {_why(e)}; pick another port, "
                f"or leave it out and relay up picks a free one"
            ) from None
        return hold_port(_bind_host(host))


def hold_service_ports(cfgs: dict, movable: set[str]) -> Listeners:
    """Bind and hold the ports of ``cfgs`` (``broker``, ``reward``, ``generator``: the plan's configs), moving
    those in ``movable`` (``http``, ``ingest``, ``reward``) that are taken to free ones, in every config that
    names them (the generators' broker address and reward URL follow). PortTaken for a taken port the user
    set. ``cfgs["http_port"]``, when present, follows the broker's HTTP port."""
    from broker.client.connection import split_addresses

    held = Listeners()
    try:
        broker, reward, gen = cfgs["broker"], cfgs["reward"], cfgs["generator"]
        port = int(broker.get("http_port", 8080))
        if port:
            s = _hold(
                broker.get("http_host", "127.0.0.1"), port, "http" in movable, "--dashboard-port or broker.http_port"
            )
            held.add("broker", s)
            broker["http_port"] = s.getsockname()[1]
            if "http_port" in cfgs:
                cfgs["http_port"] = broker["http_port"]
        workers = int(broker.get("ingest_workers", 1))
        hp = tcp_host_port(str(broker.get("ingest_bind", "")))
        if hp is not None and hp[1]:
            host, first = hp
            try:
                socks = [hold_port(_bind_host(host), first + k) for k in range(workers)]
            except OSError as e:
                if "ingest" not in movable:
                    what = f"{host}:{first}-{first + workers - 1}" if workers > 1 else f"{host}:{first}"
                    raise PortTaken(
                        f"cannot listen on {what} (broker.ingest_bind; worker k binds its port + k): "
                        f"{_why(e)}; pick another port, or leave it out and relay up picks "
                        f"a free one"
                    ) from None
                socks = hold_port_run(workers, _bind_host(host))
            held.add("broker", *socks)
            new = socks[0].getsockname()[1]
            if new != first:
                broker["ingest_bind"] = broker["ingest_bind"].replace(f":{first}", f":{new}")
                addresses = split_addresses(str(gen.get("broker_address", "")))
                gen["broker_address"] = ",".join(_moved(a, first, new, workers) for a in addresses)
        port = int(reward.get("port", 8090))
        if port:
            s = _hold(reward.get("host", "127.0.0.1"), port, "reward" in movable, "reward.port")
            held.add("reward", s)
            new = s.getsockname()[1]
            if new != port:
                reward["port"] = new
                if gen.get("reward", {}).get("url"):
                    gen["reward"]["url"] = gen["reward"]["url"].replace(f":{port}", f":{new}")
    except BaseException:
        held.close()
        raise
    return held


def _moved(address: str, first: int, new: int, workers: int) -> str:
    """A generator's broker address with the ingest ports moved from ``first``+k to ``new``+k."""
    hp = tcp_host_port(address)
    if hp is None or not first <= hp[1] < first + workers:
        return address  # not one of the run's (an explicit gateway): as it was
    return address.replace(f":{hp[1]}", f":{new + hp[1] - first}")
