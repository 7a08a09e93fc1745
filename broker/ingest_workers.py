"""Broker ingest workers (``broker.ingest_workers`` = N > 1): N processes validate and append groups,
so one Python process is not the ceiling of a run's ingest (``relay bench ingest_scaling``).

Worker 0 is the broker process itself (beside its prompt feeder, evaluations and dashboard); workers
1..N-1 are child processes started here, each with its own ROUTER socket on ingest_bind's port + k,
its own Redis connection and its own CURVE authenticator (the broker's certificate and allow-list).
Producers connect one DEALER to every worker's address (``RunInfo.ingest_addresses``; a generator's
``broker_address`` lists them) and ZeroMQ spreads their groups round-robin. Nothing is shared but
Redis: de-duplication, the queue bound and the append are one Lua script per batch, atomic across
workers, so both stay exact whatever worker a group (or its resend) reaches.

A worker that exits is restarted by the broker, after 0.5 s doubling to 10 s while it keeps failing
(``ingest_worker_restarts`` in ``stats:broker``, an ``ingest_worker_restarted`` event); the groups it
held unacknowledged are resent by their producers.
A worker whose broker is gone exits by itself. Its config comes on its standard input (JSON), never
on its command line (the Redis URL may carry a password).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import redis
from prometheus_client import CollectorRegistry

from broker.client.connection import Backoff, connect_redis
from broker.client.telemetry import emit_event
from broker.config import BrokerConfig
from broker.ingest import Ingest
from broker.protocol.keys import Keys
from broker.protocol.signing import announce_verifier
from broker.runtime.heap import freeze_startup_objects
from broker.runtime.ports import LISTEN_FDS, handed_over_bind

log = logging.getLogger("relay.broker.workers")


def serve(cfg: BrokerConfig, stop: threading.Event, alive=lambda: True) -> None:
    """One ingest worker: bind ``cfg.ingest_bind`` and serve batches until ``stop`` is set or ``alive()``
    turns false. Redis unavailable: nothing is acknowledged; the producers resend once it is back."""
    r = connect_redis(cfg.redis_url)
    ingest = Ingest(
        r,
        Keys(cfg.run_id),
        cfg,
        CollectorRegistry(),
        announce_verifier(cfg.announce_auth, cfg.announce_public_key_file),
    )
    sock = ingest.bind()
    freeze_startup_objects()  # broker/runtime/heap.py
    try:
        while not stop.is_set() and alive():
            try:
                ingest.serve(sock, 100)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                log.warning("redis unavailable (%s); retrying", e)
                time.sleep(0.5)
    finally:
        ingest.close(sock)


class Workers:
    """The broker's ingest workers 1..N-1 (worker 0 is the broker's own loop): started, restarted when
    one exits (:meth:`check`, from the broker's loop), stopped with the broker."""

    def __init__(self, cfg: BrokerConfig, r: redis.Redis, keys: Keys, log_json: bool = False):
        self.cfg, self.r, self.keys, self.log_json = cfg, r, keys, log_json
        self.binds = cfg.ingest_binds()
        self.procs: dict[int, subprocess.Popen] = {}
        self.started_at: dict[int, float] = {}
        self.retry_at: dict[int, float] = {}  # a worker that exited: when it is started again
        self.backoff: dict[int, Backoff] = {}  # per worker: 0.5 s doubling to 10 s while it keeps exiting
        self.restarts = 0

    def _start(self, k: int) -> None:
        worker_cfg = self.cfg.model_copy(update={"ingest_bind": self.binds[k], "ingest_workers": 1})
        cmd = [sys.executable, "-m", "broker.ingest_workers", str(k), *(["--log-json"] if self.log_json else [])]
        fd = handed_over_bind(self.binds[k])  # the socket relay up holds for this worker's address, passed on
        fds = (fd,) if fd is not None else ()
        env = {**os.environ, LISTEN_FDS: ",".join(map(str, fds))}
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, text=True, pass_fds=fds, env=env)
        proc.stdin.write(worker_cfg.model_dump_json())
        proc.stdin.close()
        self.procs[k] = proc
        self.started_at[k] = time.monotonic()
        log.info("ingest worker %d (pid %d) on %s", k, proc.pid, self.binds[k])

    def start(self) -> "Workers":
        for k in range(1, len(self.binds)):
            self._start(k)
        return self

    def check(self) -> None:
        """Restart every worker that has exited (counted, an event on the dashboard) after 0.5 s, a wait
        that doubles up to 10 s while it keeps exiting within a minute of its start (a port taken, say)."""
        now = time.monotonic()
        for k, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            if k not in self.retry_at:
                backoff = self.backoff.setdefault(k, Backoff(0.5, 10.0))
                if now - self.started_at[k] > 60:
                    backoff.reset()  # it had been serving: the shortest wait
                delay = backoff.next()
                self.retry_at[k] = now + delay
                log.warning(
                    "ingest worker %d exited with %s; restarting it in %.1fs (its producers resend what it held)",
                    k,
                    code,
                    delay,
                )
            if now < self.retry_at[k]:
                continue
            del self.retry_at[k]
            self.restarts += 1
            self.r.hincrby(self.keys.stats("broker"), "ingest_worker_restarts", 1)
            emit_event(self.r, self.keys, "ingest_worker_restarted", worker=k, exit_code=code)
            self._start(k)

    def stop(self, timeout_s: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for k, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("ingest worker %d did not stop in %.0fs; killing it", k, timeout_s)
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one broker ingest worker (started by the broker; config on stdin)")
    p.add_argument("index", type=int)
    p.add_argument("--log-json", action="store_true")
    a = p.parse_args(argv)
    from broker.runtime.logs import setup_logging

    setup_logging("broker", f"ingest-{a.index}", as_json=a.log_json)
    cfg = BrokerConfig.model_validate_json(sys.stdin.read())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    parent = os.getppid()
    serve(cfg, stop, alive=lambda: os.getppid() == parent)  # the broker gone: this worker goes too
    return 0


if __name__ == "__main__":
    sys.exit(main())
