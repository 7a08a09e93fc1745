"""A generator's sign of life while its engine computes.

The supervisor (``relay up --hang-after``) takes a generator whose heartbeat stops for too long for
hung and restarts it. The main thread heartbeats between engine steps (``Backend.alive``), but one
step can itself take minutes: vLLM's LoRA ops on CPU gather an adapter matrix per token, and a batch's
prefill beside a learner on two shared cores took over 2 minutes (docs/generators.md). Such a
generator is busy, not hung.

:class:`ComputeWatch` tells the two apart by the main thread's CPU time (Linux: ``/proc/self/task/<tid>/
stat``): every ``every_s`` it heartbeats when the thread has run since its last look. A thread that is
stuck waiting (a deadlock, a socket that never answers) uses no CPU and goes silent; a frozen process
(SIGSTOP) runs no thread at all. What it cannot tell from busy is a thread spinning forever.

:class:`DecodeHook` is the hook a backend calls between its steps (``Backend.alive``): a heartbeat,
and once the generator is stopping (SIGTERM, Ctrl-C under ``relay up``), a batch still generating
``STOP_GRACE_S`` after the stop is abandoned (:class:`GenerationStopped`): its prompts stay pending
and are taken by another generator (or the resumed run), instead of the stop waiting for a batch of
minutes (a 4096-token batch held a Ctrl-C for 49 s).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import redis

from broker.runtime.procstat import stat_cpu_s

log = logging.getLogger("relay.generator.liveness")


def thread_cpu_s(native_id: int) -> float | None:
    """CPU seconds (user + system) the thread ``native_id`` of this process has used; None where
    ``/proc`` cannot say (not Linux, or the thread is gone)."""
    return stat_cpu_s(f"/proc/self/task/{native_id}/stat")


class ComputeWatch(threading.Thread):
    """Calls ``beat()`` every ``every_s`` while ``thread`` keeps using CPU; stops when ``stop`` is set
    or the thread's CPU time cannot be read (the heartbeats between engine steps remain)."""

    def __init__(self, thread: threading.Thread, beat: Callable[[], None], every_s: float, stop: threading.Event):
        super().__init__(name="compute-watch", daemon=True)
        self.tid, self.beat, self.every_s, self.stop = thread.native_id, beat, every_s, stop

    def run(self) -> None:
        last = thread_cpu_s(self.tid)
        if last is None:
            log.info("no per-thread CPU time here: a generator is seen alive between engine steps only")
            return
        while not self.stop.wait(self.every_s):
            now = thread_cpu_s(self.tid)
            if now is None:
                return
            if now > last:
                try:
                    self.beat()
                except redis.RedisError as e:  # the main loop sees Redis go away too, and retries
                    log.warning("heartbeat failed: %s", e)
            last = now


STOP_GRACE_S = 10.0  # a batch still generating this long after the stop is abandoned


class GenerationStopped(Exception):
    """The generator is stopping and its batch was still generating ``STOP_GRACE_S`` after the stop."""


class DecodeHook:
    """``Backend.alive``: ``beat()`` between engine steps, and :class:`GenerationStopped` from a batch still
    generating ``grace_s`` after ``stop`` was set (the batch is abandoned; its prompts stay pending)."""

    def __init__(self, beat: Callable[[], None], stop: threading.Event, grace_s: float = STOP_GRACE_S):
        self.beat, self.stop, self.grace_s = beat, stop, grace_s
        self.stopping_since: float | None = None

    def __call__(self) -> None:
        self.beat()
        if not self.stop.is_set():
            return
        now = time.monotonic()
        self.stopping_since = self.stopping_since or now
        if now - self.stopping_since > self.grace_s:
            raise GenerationStopped(
                f"stopping: the batch still generating {self.grace_s:.0f}s after the stop is "
                "abandoned; its prompts stay pending for another generator"
            )
