"""Finite numbers only, in the learner: a group whose reward, log-probs or advantages are not finite
float32 is dropped and counted before a batch is built (behind the broker's own check); a step whose
loss is NaN (advantages poisoned below both checks) is skipped by a real learner with real DeepSpeed:
the weights and the optimizer state stay bit-identical, nothing new is published, and the skip is
counted in the metrics line and /metrics."""

import json
import math
import subprocess
import sys
import threading
from collections import Counter

import numpy as np
import pytest
import redis
import torch

from broker.client import queues
from broker.client.announcements import latest_announcement
from broker.protocol import weightstore
from broker.protocol.group import encode_group
from broker.protocol.keys import Keys
from learner.config import LearnerConfig
from learner.intake import GroupIntake
from learner.publish import NonFiniteWeights, Publisher
from tests.support.data import make_group
from tests.support.services import ROOT, child_env, metric_value


def test_groups_with_nonfinite_float32_numbers_are_dropped_and_counted(redis_url):
    r, keys = redis.Redis.from_url(redis_url), Keys("nf")
    queues.ensure_groups(r, keys)
    huge = make_group(group_id="huge", run_id="nf")
    huge.samples[1].reward, huge.samples[1].reward_status = 1e300, "ok"  # finite as float64, inf as float32
    nan_logprob = make_group(group_id="nanlp", run_id="nf")
    nan_logprob.samples[0].logprobs = np.array([-0.5, np.nan, -0.1], np.float32)
    good = make_group(group_id="good", run_id="nf")
    pipe = r.pipeline()  # straight into the queue: below the broker's ingest check
    queues.append_groups(pipe, keys, 100, 1 << 30, [(g, encode_group(g)) for g in (huge, nan_logprob, good)])
    pipe.execute()
    counts = Counter()
    intake = GroupIntake(
        r,
        keys,
        LearnerConfig(run_id="nf", redis_url=redis_url, batch_groups=1, wait_timeout_s=30),
        vocab=15,
        counts=counts,
    )
    assert [g.group_id for _, g in intake.next_batch(3, threading.Event())] == ["good"]
    # the queue's decoder (the broker's, shared) already refuses both as non-finite float32: the reward of
    # 1e300 and the NaN log-prob; the learner's own check of the batch stays behind it for advantages
    assert counts["groups_undecodable"] == 2 and counts["groups_dropped_nonfinite"] == 0


def test_nonfinite_weights_are_never_published(tmp_path):
    pub = Publisher(None, Keys("nf"), str(tmp_path / "weights"), tokenizer=None, keep_versions=2)
    try:
        pub.publish(None, {"w": torch.tensor([1.0, float("nan")]), "ids": torch.tensor([1])}, 5)
        raise AssertionError("NaN weights must not be published")
    except NonFiniteWeights as e:
        assert "version 5" in str(e) and "w" in str(e)
    assert weightstore.list_versions(tmp_path / "weights") == []


@pytest.mark.slow  # a real learner with DeepSpeed (~1 min, minutes the first time: shm_comm compiles)
def test_a_nonfinite_loss_skips_the_step_and_publishes_nothing(redis_url, tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "tests.support.learner_nonfinite", redis_url, str(tmp_path)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "step 2: 1 of 1 optimizer step(s) skipped (non-finite loss" in res.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    initial, step1, step2, step3 = out["weights"]
    assert step1 != initial and step2 == step1 and step3 != step2  # the skipped step left the weights bit-identical
    assert out["optimizer_after_skip"] == out["optimizer_before"]  # and the optimizer state (AdamW's moments)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_steps"] for m in lines] == [0, 1, 1]
    assert lines[1]["updates_skipped"] == 1 and lines[1]["skip_reason"].startswith("non-finite loss")
    assert [m["version"] for m in lines] == [1, 1, 2]  # the skipped step published nothing new
    assert weightstore.list_versions(tmp_path / "weights") == [0, 1, 2]
    assert latest_announcement(redis.Redis.from_url(redis_url), Keys("bench")).version == 2
    assert metric_value(out["metrics"], "relay_learner_skipped_steps_total") == 1
    assert math.isfinite(lines[2]["loss"])


@pytest.mark.slow  # six DeepSpeed engines (~1 min)
def test_a_skipped_step_leaves_nothing_behind_at_every_zero_stage(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "tests.support.learner_skip_zero", str(tmp_path), "1", "2", "3"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    result = json.loads((tmp_path / "skip.json").read_text())
    for stage in ("1", "2", "3"):
        assert result[stage]["skipped"] == 1 and result[stage]["reason"].startswith("non-finite loss"), stage
        # the next finite step lands exactly where it would have without the poisoned batch
        assert result[stage]["identical"], stage
