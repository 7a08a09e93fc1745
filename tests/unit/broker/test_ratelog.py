"""RateLimitedLog: a few lines in full per interval, the rest counted into one summary line."""

import logging
import time

from broker.runtime.ratelog import RateLimitedLog


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_flood_is_logged_as_a_few_lines_and_one_summary_per_interval(caplog):
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("test.ratelog"), "refusals", interval_s=10, burst=3, clock=clock)
    with caplog.at_level(logging.WARNING, "test.ratelog"):
        for i in range(1000):
            rl.log(f"key-{i % 7}", "refused %s", f"key-{i % 7}")
        assert [r.getMessage() for r in caplog.records] == ["refused key-0", "refused key-1", "refused key-2"]
        clock.t += 10  # the next interval: its first event writes the summary of the last one, then itself
        rl.log("key-x", "refused %s", "key-x")
        msgs = [r.getMessage() for r in caplog.records]
        assert msgs[3] == (
            "997 more refusals in the last 10 s, not logged one by one (from 7 distinct, the last key-5)"
        )
        assert msgs[4:] == ["refused key-x"]
        rl.close()  # nothing held back since: no summary
        assert len(caplog.records) == 5


def test_the_summary_comes_when_the_flood_stops(caplog):
    rl = RateLimitedLog(logging.getLogger("test.ratelog2"), "refusals", interval_s=0.3, burst=1)
    with caplog.at_level(logging.WARNING, "test.ratelog2"):
        for _ in range(50):
            rl.log("k", "refused")
        deadline = time.monotonic() + 5
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r.getMessage() for r in caplog.records] == [
            "refused",
            "49 more refusals in the last 0.3 s, not logged one by one (from 1 distinct, the last k)",
        ]
