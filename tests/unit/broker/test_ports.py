"""The launcher's free ports are drawn outside the kernel's ephemeral range, where no outgoing
connection can take one between the pick and the service's bind (broker/runtime/ports.py)."""

import socket

import pytest

from broker.runtime import ports


def test_ports_are_free_and_outside_the_ephemeral_range():
    lo, hi = ports.ephemeral_range()
    picked = {ports.free_port() for _ in range(50)}
    assert len(picked) > 40  # drawn at random, not one port handed out again and again
    for port in picked:
        assert ports.LOWEST <= port <= 65535 and not lo <= port <= hi, (port, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: it binds


def test_a_port_in_use_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # a range with room for one port only, the taken one: the pick falls back to the kernel's
        monkeypatch.setattr(ports, "LOWEST", taken)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 1, 65535))
        assert ports.port_in_use(taken)
        got = ports.free_port(tries=5)
        assert got != taken


@pytest.mark.parametrize("rng", [(1024, 65535), (20000, 65535)])
def test_no_room_outside_the_ephemeral_range_falls_back_to_the_kernels_pick(monkeypatch, rng):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: rng)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_run_of_consecutive_ports():
    base = ports.free_port_run(3)
    for k in range(3):
        assert not ports.port_in_use(base + k)
