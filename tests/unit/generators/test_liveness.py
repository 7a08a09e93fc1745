"""ComputeWatch (generators/liveness.py): a generator's main thread inside one long engine step still
heartbeats while it computes, and goes silent when it is stuck waiting."""

import threading
import time

from generators.liveness import ComputeWatch, thread_cpu_s


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += sum(range(1000))


def test_thread_cpu_time_grows_with_work_and_not_with_waiting():
    me = threading.current_thread().native_id
    t0 = thread_cpu_s(me)
    _burn(0.3)
    t1 = thread_cpu_s(me)
    threading.Event().wait(0.3)
    t2 = thread_cpu_s(me)
    assert t0 is not None and t1 - t0 > 0.05
    assert t2 - t1 < 0.02
    assert thread_cpu_s(2**31 - 1) is None  # no such thread


def test_beats_while_the_thread_computes_silent_while_it_waits_and_stops_when_told():
    every_s, beats, switched = 0.2, [], {}
    stop, blocked = threading.Event(), threading.Event()

    def work():
        _burn(2.0)  # one long engine step: no heartbeat of its own
        switched["at"] = time.monotonic()
        blocked.wait()  # stuck waiting: a deadlock, a socket that never answers

    worker = threading.Thread(target=work)
    worker.start()
    watch = ComputeWatch(worker, lambda: beats.append(time.monotonic()), every_s, stop)
    watch.start()
    time.sleep(4.5)
    stop.set()
    watch.join(2)
    blocked.set()
    worker.join(2)
    assert not watch.is_alive()
    busy = [t for t in beats if t < switched["at"]]
    assert len(busy) >= 3, beats  # up to one per 0.2 s of the 2 s step (fewer on a loaded machine)
    # The looks that straddle the switch may still see the step's last CPU time (the kernel accounts a
    # running thread's time at ticks and switches); a second after it, a waiting thread is silent.
    late = [round(t - switched["at"], 2) for t in beats if t > switched["at"] + 1.0]
    assert late == [], late
