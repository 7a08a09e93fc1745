"""A generator's Progress (generators/heartbeats.py): each batch counted and logged with where its time went,
the sampling and the wait since the previous batch ended."""

import logging
import time

from generators.heartbeats import Progress


def test_each_batch_is_logged_with_its_sampling_time_and_the_wait_before_it(caplog):
    p = Progress()
    caplog.set_level(logging.INFO, logger="relay.generator")
    t0 = time.monotonic() - 2.0
    p.batch_done(t0, samples=8, tokens=400, versions=(3, 3))
    first = caplog.records[-1].getMessage()
    assert "batch 1: 8 samples, 400 tokens in 2." in first and "version 3;" in first and "the first" in first
    assert p.tokens == 400 and 190 < p.tokens_per_s < 201
    time.sleep(0.3)  # admission closed, say
    started = time.monotonic()
    time.sleep(0.1)
    p.batch_done(started, samples=8, tokens=100, versions=(3, 4))
    second = caplog.records[-1].getMessage()
    assert "batch 2:" in second and "version 3 to 4" in second
    waited = float(second.split("waited ")[1].split(" s")[0])
    assert 0.25 < waited < 2.0
    assert p.batches == 2 and p.tokens == 500
