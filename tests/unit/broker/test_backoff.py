"""The one back-off helper (broker/client/connection.py) gives each retry loop the delays it had."""

import pytest

from broker.client.connection import Backoff


def test_delays_grow_by_the_factor_up_to_the_cap_and_start_over_on_reset():
    release = Backoff(0.2, 5.0)  # prompt release and the reward client: 0.2 s doubling to 5 s
    assert [release.next() for _ in range(7)] == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
    release.reset()
    assert release.next() == 0.2
    busy = Backoff(0.05, 1.0, factor=1.5)  # the sender's wait after consecutive busy acks
    assert [busy.next() for _ in range(9)] == pytest.approx(
        [0.05, 0.075, 0.1125, 0.16875, 0.253125, 0.3796875, 0.56953125, 0.854296875, 1.0]
    )
    assert Backoff(0.5, 10.0).delay(6) == 10.0  # the supervisor's restart delay, by attempt number


def test_at_cap_says_when_the_next_wait_is_the_longest():
    b = Backoff(0.2, 5.0)
    waits = 0
    while not b.at_cap:  # a stopping generator gives up releasing a prompt once here
        b.next()
        waits += 1
    assert waits == 5 and b.next() == 5.0


def test_a_retry_loop_that_lasts_for_hours_stays_at_the_cap():
    # factor ** attempt overflowed a float after ~1,750 busy acks (about 30 minutes of a full queue at the
    # 1 s cap): the sender crashed with OverflowError instead of waiting on
    busy = Backoff(0.05, 1.0, factor=1.5)
    assert [busy.next() for _ in range(5000)][-1] == 1.0
    assert Backoff(0.5, 10.0).delay(10**6) == 10.0 and Backoff(0.5, 10.0, factor=1.0).delay(10**6) == 0.5
