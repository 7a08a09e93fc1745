"""Staleness admission (AReaL's rule, eta = 1): with the learner stopped, generators take new prompts
only until (eta + learner progress + 1) x batch are issued, then pause visibly (state
paused_staleness) instead of producing samples the learner would drop; a restarted learner lets them
resume."""

import signal
import time

import pytest
import redis

from broker.client import queues
from broker.client.telemetry import read_heartbeats, read_stats
from broker.protocol.keys import Keys
from broker.protocol.messages import PromptEntry
from tests.support.services import generator_cfg, start_broker_and_reward, start_service, wait_until


@pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)
def test_generators_pause_while_the_learner_is_stopped_and_resume_after(procs, redis_url, tmp_path):
    run, batch, eta = "adm", 4, 1
    svc = start_broker_and_reward(procs, redis_url, tmp_path, run)
    learner_cfg = {
        "run_id": run,
        "redis_url": redis_url,
        "run_dir": str(tmp_path / "learner"),
        "weight_store": str(tmp_path / "weights"),
        "steps": 1000,
        "batch_groups": batch,
        "admission_eta": eta,
        "checkpoint_every": 2,
        "keep_versions": 20,
    }
    learner = start_service(procs, "learner", "learner", learner_cfg, tmp_path)
    for i in range(2):
        start_service(
            procs,
            f"gen-{i}",
            "generator",
            generator_cfg(svc, redis_url, run, f"gen-{i}", prompts_per_batch=2, claim_idle_s=5),
            tmp_path,
        )
    r, keys = redis.Redis.from_url(redis_url), Keys(run)

    def step() -> int:
        return int(read_stats(r, keys, "learner").get("step", 0))

    def consumed() -> int:
        return int(read_stats(r, keys, "learner").get("consumed", 0))

    wait_until(lambda: step() >= 4, 240, "learner progress")
    learner.proc.send_signal(signal.SIGTERM)
    learner.proc.wait(60)

    # learner stopped: both generators pause on staleness; what was issued respects the bound
    hbs = wait_until(
        lambda: (
            (g := read_heartbeats(r, keys))
            and len(g) == 2
            and all(h.state == "paused_staleness" for h in g.values())
            and g
        ),
        120,
        "both generators paused on staleness",
    )
    issued = int(r.get(keys.issued))
    assert issued <= consumed() + (eta + 1) * batch, (issued, consumed())
    appended = r.scard(keys.seen)
    time.sleep(3.0)
    assert r.scard(keys.seen) == appended, "generators kept producing while the learner was stopped"
    assert int(r.get(keys.issued)) == issued
    assert all(h.state == "paused_staleness" for h in read_heartbeats(r, keys).values()), hbs

    # learner restarted: admission reopens as it consumes, the generators sample again
    stopped_at = step()
    start_service(procs, "learner2", "learner", learner_cfg, tmp_path)
    wait_until(lambda: step() >= stopped_at + 4, 240, "the restarted learner's progress")
    assert r.scard(keys.seen) > appended and int(r.get(keys.issued)) > issued
    assert int(r.get(keys.issued)) <= consumed() + (eta + 1) * batch + batch  # the bound still holds (one step of slack
    # for reads in flight)


def test_admission_and_claim_are_one_step_so_issued_counts_exactly_the_prompts_read(redis_url):
    """A generator killed at any moment of its claim holds no grant it did not use: the grant and the
    read are one script. With eta 0 a leaked grant would leave the learner waiting forever for groups
    nobody may produce (seen once before the change: issued 1312, prompts claimed 1304)."""
    r, keys = redis.Redis.from_url(redis_url), Keys("atomic")
    queues.ensure_groups(r, keys)
    r.hset(keys.admission, mapping={"batch_groups": 3, "eta": 0})
    # an empty stream: granted, nothing read, nothing issued (the two-step form issued 3 here)
    assert queues.admit_and_claim(r, keys, "g0", 8) == (3, []) and int(r.get(keys.issued) or 0) == 0
    for i in range(5):
        queues.add_prompt(r, keys.prompts, PromptEntry(text=f"q{i}", seq=i))
    grant, got = queues.admit_and_claim(r, keys, "g0", 2)
    assert grant == 2 and [p.seq for _, p in got] == [0, 1] and int(r.get(keys.issued)) == 2
    grant, got = queues.admit_and_claim(r, keys, "g1", 8)  # the bound: (eta + 0 + 1) x 3
    assert grant == 1 and [p.seq for _, p in got] == [2] and int(r.get(keys.issued)) == 3
    assert queues.admit_and_claim(r, keys, "g1", 8) == (0, [])  # at the bound: paused
    r.hincrby(keys.stats("learner"), "consumed", 3)  # the learner trained a batch
    grant, got = queues.admit_and_claim(r, keys, "g0", 8)
    assert grant == 3 and [p.seq for _, p in got] == [3, 4] and int(r.get(keys.issued)) == 5
    pending = r.xpending(keys.prompts, "generators")
    assert pending["pending"] == 5 and {c["name"]: c["pending"] for c in pending["consumers"]} == {b"g0": 4, b"g1": 1}
