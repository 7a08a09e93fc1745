"""The learner's intake ends a run whose data is used up (learner/intake.py), on a real Redis: only
once the feeder marked the dataset exhausted, every prompt is released and every group read; the
groups of an unfinished last batch stay queued (unacknowledged), never trained or lost."""

import threading
from collections import Counter

import redis

from broker.client import queues
from broker.protocol.group import encode_group
from broker.protocol.keys import Keys
from broker.protocol.messages import PromptEntry
from learner.config import LearnerConfig
from learner.intake import GroupIntake
from tests.support.data import make_group


def test_the_intake_ends_only_when_no_group_can_come(redis_url):
    r, keys = redis.Redis.from_url(redis_url), Keys("e")
    queues.ensure_groups(r, keys)
    pipe = r.pipeline()
    queues.append_groups(
        pipe,
        keys,
        100,
        1 << 30,
        [(g, encode_group(g)) for g in (make_group(group_id=f"g{i}", run_id="e") for i in range(3))],
    )
    pipe.execute()
    queues.add_prompt(r, keys.prompts, PromptEntry(text="1=", reference="1", task="copy"))  # still being answered
    r.hset(keys.stats("broker"), "dataset_exhausted", 1)
    cfg = LearnerConfig(run_id="e", redis_url=redis_url, batch_groups=2, wait_timeout_s=30)
    intake = GroupIntake(r, keys, cfg, vocab=15, counts=Counter())
    stop = threading.Event()

    assert [g.group_id for _, g in intake.next_batch(3, stop)] == ["g0", "g1"]
    assert not intake.out_of_data()  # a prompt is still out: its group may come
    r.delete(keys.prompts)  # its generator released it (its group is g2, already queued)
    assert not intake.out_of_data()  # g2 is not read yet
    assert intake.next_batch(3, stop) is None and intake.data_ended  # g2 read, and no second group can come
    # g0 and g1 until the trainer commits them; g2 left over, unacknowledged (the audit counts it queued)
    assert queues.pending_groups(r, keys) == 3 and queues.waiting_groups(r, keys) == 0

    r.hset(keys.stats("broker"), "dataset_exhausted", 0)  # a dataset not used up never ends the run here
    assert not GroupIntake(r, keys, cfg, vocab=15, counts=Counter()).out_of_data()


def test_drops_are_published_as_they_happen_not_at_the_next_step(redis_url):
    """During a reward outage every group is dropped and no training step comes: the learner's stats
    (what the dashboard and `relay status` read) show the drops at once."""
    r, keys = redis.Redis.from_url(redis_url), Keys("d")
    queues.ensure_groups(r, keys)
    failed = [make_group(group_id=f"f{i}", run_id="d") for i in range(3)]
    for g in failed:
        g.samples = [g.samples[1]]  # only the sample whose reward failed
    ok = make_group(group_id="ok", run_id="d")
    pipe = r.pipeline()
    queues.append_groups(pipe, keys, 100, 1 << 30, [(g, encode_group(g)) for g in [*failed, ok]])
    pipe.execute()
    cfg = LearnerConfig(run_id="d", redis_url=redis_url, batch_groups=2, wait_timeout_s=30)
    intake = GroupIntake(r, keys, cfg, vocab=15, counts=Counter())
    stop = threading.Event()
    threading.Timer(3.0, stop.set).start()  # the batch never fills: one trainable group only
    assert intake.next_batch(3, stop) is None
    assert r.hget(keys.stats("learner"), "groups_dropped_reward_failed") == b"3"
