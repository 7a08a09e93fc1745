"""The launcher's free ports are drawn outside the kernel's ephemeral range, where no outgoing
connection can take one between the pick and the service's bind (broker/runtime/ports.py)."""

import os
import socket
import subprocess
import sys

import pytest

from broker.runtime import ports
from tests.support.services import ROOT


def test_ports_are_free_and_outside_the_ephemeral_range():
    lo, hi = ports.ephemeral_range()
    picked = set()
    for _ in range(50):
        port = ports.free_port()
        assert ports.LOWEST <= port <= 65535 and not lo <= port <= hi, (port, lo, hi)
        # free: it binds, right after the pick (make test's other worker starts services on ports of the same
        # range: checking all 50 after the last pick once found one of them taken in between)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        picked.add(port)
    assert len(picked) > 40  # drawn at random, not one port handed out again and again


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


# Bind and hold (broker/runtime/ports.py hold_port, handed_over): a port relay up chooses is its own from
# that moment, and the service it starts serves on the very socket (before, the port was closed again and
# bound seconds later by the service, and a run started beside another died with EADDRINUSE).

_HOLDER = """
import socket, sys, time
s = socket.create_server(("127.0.0.1", int(sys.argv[1])), backlog=8)
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


def _held_by_another_process(port: int = 0):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(port)], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def test_a_held_port_cannot_be_taken_and_a_port_another_process_holds_is_never_handed_out():
    s = ports.hold_port()
    port = s.getsockname()[1]
    lo, hi = ports.ephemeral_range()
    assert ports.LOWEST <= port and not lo <= port <= hi
    holder = subprocess.run(
        [sys.executable, "-c", _HOLDER.replace("time.sleep(60)", ""), str(port)], capture_output=True, text=True
    )
    assert holder.returncode != 0 and "Address already in use" in holder.stderr  # ours until closed
    s.close()
    proc, theirs = _held_by_another_process()
    try:
        with pytest.raises(OSError):
            ports.hold_port(port=theirs)
        run = ports.hold_port_run(3)
        assert [x.getsockname()[1] - run[0].getsockname()[1] for x in run] == [0, 1, 2]
        assert theirs not in {x.getsockname()[1] for x in run}
        for x in run:
            x.close()
    finally:
        proc.kill()
        proc.wait()


_SERVICE = """
import sys
from broker.runtime.ports import handed_over
s = handed_over("127.0.0.1", int(sys.argv[1]))
assert handed_over("127.0.0.1", int(sys.argv[1]) + 1) is None and handed_over("10.9.8.7", int(sys.argv[1])) is None
conn, _ = s.accept()
conn.sendall(b"served by the child")
conn.close()
"""


def test_a_service_serves_on_the_socket_its_launcher_handed_over():
    s = ports.hold_port()
    port = s.getsockname()[1]
    env = {**os.environ, ports.LISTEN_FDS: str(s.fileno()), "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _SERVICE, str(port)], pass_fds=(s.fileno(),), env=env)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            c.settimeout(30)
            assert c.recv(100) == b"served by the child"
        assert child.wait(30) == 0
    finally:
        child.kill()
        s.close()
