"""The learner killed with SIGKILL mid-run and restarted: it resumes from its checkpoint, versions
keep increasing, and the broker's records show every group trained exactly once or accounted
for (dropped with a reason, or still queued): none lost, none trained twice. Once without ZeRO in
fp32, once with ZeRO-2 in bf16 (fp32 master weights and AdamW moments partitioned by DeepSpeed), and once
with the critic on (gae): both models resume from the checkpoint."""

import json

import pytest
import redis

from broker.client import queues
from broker.client.telemetry import read_stats
from broker.protocol.keys import Keys
from tests.support.services import generator_cfg, start_broker_and_reward, start_service, wait_until


def _step(r, keys) -> int:
    return int(read_stats(r, keys, "learner").get("step", 0))


@pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)
@pytest.mark.parametrize(
    "engine,extra",
    [
        ({"zero_stage": 0, "bf16": False}, {}),
        ({"zero_stage": 2, "bf16": True}, {"lora": {"rank": 8}}),
        ({"zero_stage": 0, "bf16": False}, {"advantage": "gae", "critic": {"enabled": True}}),
    ],
    ids=["zero0-fp32", "zero2-bf16-lora", "critic-gae"],
)
def test_learner_sigkill_resume_trains_each_group_exactly_once(procs, redis_url, tmp_path, engine, extra):
    run, steps, batch = "resume", 40, 8
    svc = start_broker_and_reward(procs, redis_url, tmp_path, run)
    learner_cfg = {
        "run_id": run,
        "redis_url": redis_url,
        "run_dir": str(tmp_path / "learner"),
        "weight_store": str(tmp_path / "weights"),
        "steps": steps,
        "batch_groups": batch,
        "checkpoint_every": 5,
        "keep_versions": 50,
        "deepspeed": engine,
        **extra,
    }
    learner = start_service(procs, "learner", "learner", learner_cfg, tmp_path)
    for i in range(2):
        start_service(
            procs,
            f"gen-{i}",
            "generator",
            generator_cfg(svc, redis_url, run, f"gen-{i}", prompts_per_batch=4, claim_idle_s=5),
            tmp_path,
        )
    r, keys = redis.Redis.from_url(redis_url), Keys(run)
    wait_until(lambda: _step(r, keys) >= 13, 240, f"learner progress:\n{learner.tail()}")
    learner.proc.kill()  # SIGKILL: no clean-up, some trained groups not yet held by a checkpoint
    learner.proc.wait(10)
    killed_at = _step(r, keys)
    ckpt = tmp_path / "learner" / "checkpoints"
    held = json.loads((ckpt / (ckpt / "latest").read_text() / "state.json").read_text())
    assert (held["zero_stage"], held["bf16"]) == (engine["zero_stage"], engine["bf16"])
    critic, lora = "critic" in extra, "lora" in extra
    assert (held["critic"] is not None) == critic
    assert held.get("adapters_only", False) == lora
    if lora:  # the adapters alone: the frozen base comes from the model folder again
        from safetensors import safe_open

        with safe_open(str(ckpt / (ckpt / "latest").read_text() / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names[:5]
    assert (ckpt / (ckpt / "latest").read_text() / "critic" / "model.safetensors").is_file() == critic
    # steps after it are trained again by the second learner; a step's checkpoint is written before its line in
    # the learner's stats, so a kill between the two leaves the checkpoint one step ahead of killed_at
    assert 5 <= held["step"] <= killed_at + 1, (held["step"], killed_at)

    before = max(int(v) for v in r.hkeys(keys.versions))  # the newest version the killed learner announced
    learner2 = start_service(procs, "learner2", "learner", learner_cfg, tmp_path)
    wait_until(lambda: r.exists(keys.done) or not learner2.alive(), 300, f"second learner:\n{learner2.tail()}")
    learner2.proc.wait(30)
    assert learner2.proc.returncode == 0, learner2.tail(30)
    log2 = learner2.log_path.read_text()
    assert "resumed from checkpoint at step" in log2

    # the audit, from the broker's records
    trained = [f[b"gid"].decode() for _, f in r.xrange(keys.trained_log)]
    dropped = {f[b"gid"].decode() for _, f in r.xrange(keys.dropped_log)}
    queued = {f[b"gid"].decode() for _, f in r.xrange(keys.trajectories)}
    appended = {m.decode() for m in r.smembers(keys.seen)}
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert len(trained) == steps * batch
    lost = appended - set(trained) - dropped - queued
    assert not lost, f"{len(lost)} groups lost"
    assert not (set(trained) & dropped)
    # admission control counted each group once, the ones trained again after the restart included
    consumed = int(read_stats(r, keys, "learner")["consumed"])
    assert consumed == len(trained) + len(dropped), (consumed, len(trained), len(dropped))
    assert r.scard(keys.counted) == 0  # every counted group was committed
    # the audit's counters (exact however long the run; its records are trimmed to a window) agree
    c = queues.audit_counts(r, keys)
    assert (c["accepted"], c["committed"], c["dropped"], c["queued"]) == (
        len(appended),
        len(trained),
        len(dropped),
        len(queued),
    ), c

    # versions only grow, across the restart too
    published = [json.loads(f[b"data"])["version"] for _, f in r.xrange(keys.events) if f[b"kind"] == b"published"]
    assert published == sorted(published) and len(set(published)) == len(published)
    assert published[-1] > killed_at

    metrics = [json.loads(ln) for ln in (tmp_path / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))  # rolled-back steps are not reported twice
    if critic:  # the critic resumed with its weights: it does not start again from zero values
        after = [m for m in metrics if m["step"] > held["step"]]
        assert all("explained_variance" in m for m in metrics) and after[0]["values_mean"] != 0.0
    if lora:  # adapters alone on the wire: each learner process sent the base once, the rest pinned to it
        from broker.client.announcements import latest_announcement
        from broker.protocol.messages import decode_announcement

        announced = {
            v: decode_announcement(raw) for v, raw in ((int(k), raw) for k, raw in r.hgetall(keys.versions).items())
        }
        carriers = sorted(v for v, a in announced.items() if a.base == v)
        # the second process's first version carries the base again (a kill can land between a step's stats line
        # and its publication, so that version is compared with what was announced, not with killed_at)
        assert carriers == [0, before + 1], (carriers, before)
        assert {a.base_digest for a in announced.values()} == {announced[0].base_digest}  # the same base, rebuilt
        assert all(a.base is not None and a.base <= v for v, a in announced.items())
        assert latest_announcement(r, keys).adapter_only
        events = [(f[b"kind"], json.loads(f[b"data"])) for _, f in r.xrange(keys.events)]
        assert not [d for k, d in events if k == b"refused"]
        applied = {d["version"] for k, d in events if k == b"applied"}
        assert len(applied - set(carriers)) >= 10  # adapters applied in place by the generators
