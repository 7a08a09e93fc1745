"""RemoteShared.close() (generators/envs/remote.py) ends a call in flight at once, even when the call
takes a moment to unwind its cancellation (as the HTTP client's connection clean-up can): the event
loop must not stop under it, or the episode waits for the call's whole time-out. Fails without the
wait in close()."""

import asyncio
import threading
import time

from generators.envs.base import EnvError
from generators.envs.remote import RemoteEnvOptions, RemoteShared


class SlowToCancel:
    """A stand-in for the HTTP caller: a call that hangs, and takes a moment (more turns of the loop)
    to unwind when cancelled; closing the caller does not yield to the loop (the case that raced)."""

    def __init__(self):
        self.started = threading.Event()

    async def post_json(self, payload, path):
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # e.g. closing its connection
            raise

    async def close(self):
        pass


def test_close_ends_a_call_whose_cancellation_takes_a_moment_to_unwind():
    shared = RemoteShared(RemoteEnvOptions(url="http://127.0.0.1:9", timeout_s=60, retries=0))
    shared.http = SlowToCancel()
    seen = []

    def call():
        try:
            shared.post("/step", {})
        except EnvError as e:
            seen.append(e.reason)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    assert shared.http.started.wait(5)
    t0 = time.monotonic()
    shared.close()
    t.join(timeout=5)
    assert not t.is_alive() and seen == ["closed"], "the call outlived close()"
    assert time.monotonic() - t0 < 5
