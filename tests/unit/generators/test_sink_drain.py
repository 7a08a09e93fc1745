"""A generator's stop waits for its sink to deliver what it holds, but not forever: a sink that dies while a
batch waits at the hand-over (found as a generator left running an hour after its `relay up` was killed:
SIGTERM set the stop, the drain waited on a full hand-over that no thread would ever empty)."""

import threading
import time

import redis

from broker.protocol.keys import Keys
from generators.config import GeneratorConfig
from generators.sink import Batch, Sink


class FailingRewards:
    """Scores nothing: each call fails after ``delay_s`` (the sink's error is fatal)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def score_groups(self, prompts, groups, decode):
        time.sleep(self.delay_s)
        raise RuntimeError("the reward client broke")


def _batch() -> Batch:
    return Batch(claimed=[], prompt_ids=[], groups=[], version=0, weight_hash="", created_at=0.0)


def test_drain_returns_when_the_sink_dies_with_a_batch_waiting():
    stop = threading.Event()
    sink = Sink(
        GeneratorConfig(broker_address="tcp://127.0.0.1:9"),
        redis.Redis(port=9),
        Keys("t"),
        FailingRewards(1.0),
        lambda ids: "",
        stop,
        lambda: None,
        curve=None,
    )
    sink.start()
    assert sink.offer(_batch(), 1.0)  # taken: being scored (1 s), then the sink fails
    time.sleep(0.2)
    assert sink.offer(_batch(), 1.0)  # waits at the hand-over, behind it
    done = threading.Event()
    threading.Thread(target=lambda: (sink.drain(), done.set()), daemon=True).start()
    assert done.wait(10), "drain waited forever on a sink that had died"
    assert not sink.alive() and "the reward client broke" in sink.error and stop.is_set()
    sink.close()
