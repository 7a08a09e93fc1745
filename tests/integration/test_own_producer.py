"""A producer of one's own, written from docs/protocol.md alone, joins a real `relay up --producers 1` run
(docs/protocol.md section 12): section 10's `build_group` and `send_group` (the verbatim copy that
tests/unit/broker/test_protocol_vectors.py keeps in step with the document), section 12's `join` and
section 7.4's admission script taken from the document itself, plus redis-py with the credentials of
the file relay up wrote. Its groups are acknowledged `ok` and trained (the learner's commit log and
counters); a key not in the allow-list gets no answer at all, its own key under another id is rejected
`wrong_generator`, and its Redis user cannot touch the replay queue."""

import json
import re
import subprocess
import sys
import time
import uuid

import msgpack
import pytest
import redis

from broker.protocol.ingest_auth import write_ingest_keys
from deploy.launcher.run_secrets import run_redis_url
from tests.support.services import ROOT, child_env
from tests.unit.broker.test_protocol_vectors import build_group, send_group

DOC = (ROOT / "docs" / "protocol.md").read_text()
STEPS, BATCH = 16, 4
TINY = {**{str(d): d + 3 for d in range(10)}, "+": 13, "=": 14}  # docs/protocol.md 3.4: <pad> <bos> <eos> 0-9 + =


def doc_join():
    """Section 12.3's `join`, executed from the document."""
    text = re.sub(r"(?m)^   ", "", DOC)  # the block is indented under a list item
    m = re.search(r"```python\n(import json\n\nimport redis\n\n\ndef join\(.*?)```", text, re.S)
    assert m, "docs/protocol.md 12.3 lost its join()"
    scope: dict = {}
    exec(m.group(1), scope)
    return scope["join"]


def doc_admit_claim() -> str:
    """Section 7.4's admission script (the one that reads the prompts), from the document."""
    m = re.search(r"which admits and reads in\none atomic step:.*?```lua\n(.*?)```", DOC, re.S)
    assert m and "XREADGROUP" in m.group(1), "docs/protocol.md 7.4 lost its admission script"
    return m.group(1)


def tokens(text: str) -> list[int]:
    return [TINY[c] for c in text]


@pytest.mark.slow  # a whole relay up run of the tiny model (~40 s)
def test_a_producer_written_from_the_docs_joins_relay_up_and_its_groups_are_trained(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "up",
            "--run-id",
            "r",
            "--producers",
            "1",
            "--steps",
            str(STEPS),
            "--generators",
            "1",
            "--dashboard-port",
            "0",
            "--no-progress",
            "--set",
            f"learner.batch.groups={BATCH}",
            "--set",
            "learner.publish.checkpoint_every=4",
            "--set",
            "broker.eval.every_versions=0",
            # the run's own generator paced (0.1 s a decode step): on a quiet machine it would otherwise
            # produce every group of the 16 steps in ~2 s, before the producer's first admission
            "--set",
            "generator.backend.step_latency_s=0.1",
        ],
        cwd=work,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run_dir = work / "runs" / "r"
    producer_file = run_dir / "secrets" / "producers" / "producer-0.json"
    try:
        deadline = time.monotonic() + 120
        while not producer_file.is_file():
            assert up.poll() is None and time.monotonic() < deadline, up.communicate()[0][-3000:]
            time.sleep(0.2)
        r, run_id, pid, address, curve = doc_join()(producer_file)
        assert (run_id, pid) == ("r", "producer-0")

        def key(name):
            return f"relay:{run_id}:{name}"

        # 7.11: the advertisement, the sampling every producer must use, the EOS id (written by the learner)
        while not {b"ingest_address", b"sampling", b"eos_token_id"} <= set(r.hgetall(key("run"))):
            assert up.poll() is None and time.monotonic() < deadline, up.communicate()[0][-3000:]
            time.sleep(0.2)
        run = {k.decode(): v.decode() for k, v in r.hgetall(key("run")).items()}
        sampling, eos = json.loads(run["sampling"]), int(run["eos_token_id"])
        assert address in run["ingest_addresses"].split(",")
        while r.get(key("latest")) is None:
            time.sleep(0.2)

        # refused: a key not in the allow-list gets no answer at all (5.4), its own key under another id is
        # rejected, and its Redis user may not write the replay queue (12.2)
        latest = msgpack.unpackb(r.get(key("latest")), raw=False)
        probe = dict(
            run_id=run_id,
            prompt_id="0-1",
            prompt_ids=[1, 7, 14],
            samples=[
                {
                    "completion_ids": [7, eos],
                    "logprobs": [-0.5, -0.5],
                    "versions": [latest["version"]] * 2,
                    "finish_reason": "stop",
                    "reward": 1.0,
                }
            ],
            weight_version=latest["version"],
            weight_hash=latest["hash"],
            sampling=sampling,
        )
        stranger = write_ingest_keys(tmp_path / "stranger", ["x"])["generators"]["x"]
        import zmq.auth

        public, secret = zmq.auth.load_certificate(stranger)
        gid = uuid.uuid4().hex
        with pytest.raises(TimeoutError):
            send_group(
                address,
                gid,
                build_group(group_id=gid, generator_id=pid, **probe),
                timeout_s=1.0,
                give_up_s=3.0,
                curve=(curve[0], public.decode(), secret.decode()),
            )
        gid = uuid.uuid4().hex
        ack = send_group(
            address,
            gid,
            build_group(group_id=gid, generator_id="gen-0", **probe),
            timeout_s=5.0,
            give_up_s=60.0,
            curve=curve,
        )
        assert (ack["status"], ack["reason"]) == ("rejected", "wrong_generator"), ack
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.xadd(key("trajectories"), {"gid": "forged", "v": "0", "gen": pid})
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set(key("latest"), b"forged")

        # the loop of section 8, with the admission script of 7.4 as the document prints it
        admit = r.register_script(doc_admit_claim())
        watch = redis.Redis.from_url(run_redis_url(run_dir))  # the launcher's read-only user: the audit's view
        acks, sent, trained = [], [], set()
        while not r.exists(key("done")):
            assert up.poll() is None and time.monotonic() < deadline + 240, up.communicate()[0][-3000:]
            _grant, entries = admit(
                keys=[key("admission"), key("stats:learner"), key("stats:broker"), key("issued"), key("prompts")],
                args=[4, "generators", pid],
            )
            latest = msgpack.unpackb(r.get(key("latest")), raw=False)
            for eid, fields in entries:
                f = {k.decode(): v.decode() for k, v in zip(fields[::2], fields[1::2])}
                right = tokens(f["reference"]) + [eos]
                samples = [
                    {
                        "completion_ids": right if i % 2 == 0 else [TINY["0"], eos],
                        "logprobs": [-0.25] * (len(right) if i % 2 == 0 else 2),
                        "versions": [latest["version"]] * (len(right) if i % 2 == 0 else 2),
                        "finish_reason": "stop",
                        "reward": 1.0 if i % 2 == 0 else 0.0,
                    }
                    for i in range(sampling["n"])
                ]
                gid = uuid.uuid4().hex
                payload = build_group(
                    group_id=gid,
                    run_id=run_id,
                    prompt_id=eid.decode(),
                    prompt_ids=[1] + tokens(f["text"]),
                    samples=samples,
                    generator_id=pid,
                    weight_version=latest["version"],
                    weight_hash=latest["hash"],
                    sampling=sampling,
                    task=f["task"],
                    reference=f["reference"],
                    scored_at=time.time(),
                )
                acks.append(send_group(address, gid, payload, timeout_s=10.0, give_up_s=120.0, curve=curve))
                sent.append(gid)
                with r.pipeline(transaction=True) as pipe:  # 7.2 step 5: released after the final ack
                    pipe.xack(key("prompts"), "generators", eid)
                    pipe.xdel(key("prompts"), eid)
                    pipe.execute()
            r.hset(
                key("generators"),
                pid,
                json.dumps(
                    {
                        "id": pid,
                        "version": latest["version"],
                        "hash": latest["hash"],
                        "last_seen": time.time(),
                        "state": "sampling",
                        "groups_sent": len(sent),
                    }
                ),
            )
            trained |= {
                g for g in sent if watch.sismember(key("trained"), g) or watch.sismember(key("trained_prev"), g)
            }
            if not entries:
                time.sleep(0.05)
        trained |= {g for g in sent if watch.sismember(key("trained"), g) or watch.sismember(key("trained_prev"), g)}
        committed = int(watch.hget(key("stats:learner"), "committed") or 0)
        log = {e[1][b"gid"].decode() for e in watch.xrange(key("trained_log"))}
        r.hset(
            key("generators"),
            pid,
            json.dumps(
                {
                    "id": pid,
                    "version": latest["version"],
                    "hash": latest["hash"],
                    "last_seen": time.time(),
                    "state": "stopped",
                    "groups_sent": len(sent),
                }
            ),
        )
        out, _ = up.communicate(timeout=180)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 0, out[-3000:]
    print(
        f"producer-0: {len(sent)} groups acknowledged, {len(trained)} of them seen committed; the learner "
        f"committed {committed} in all"
    )
    assert "1 producer of your own may join as producer-0" in out and str(producer_file.parent) in out, out
    assert acks and all(a["status"] == "ok" for a in acks), [a for a in acks if a["status"] != "ok"][:3]
    assert trained and trained <= log, (len(sent), len(trained))  # trained: in the commit log of the run
    assert committed >= len(trained)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["audit"]["lost"] == 0, s["audit"]
    assert s["groups_rejected"] >= 1  # the wrong_generator probe, counted like every rejection
    assert s["generators"]["producer-0"]["groups_sent"] == len(sent)  # its heartbeat, read by relay up
    assert (run_dir / "logs" / "broker.log").read_text().count(public.decode()) >= 1  # the refused key, logged
    assert s["redis_refused"], s.get("redis_refused")  # the producer's forbidden writes, reported


@pytest.mark.slow  # a relay up run stopped and resumed (~60 s)
def test_a_resumed_run_keeps_its_producer_and_rewrites_its_file_with_the_new_addresses(tmp_path):
    """relay up --resume keeps the producers of --producers (their keys in the allow-list, their Redis users
    and passwords) and writes their files again, which the producer reads again to send and be answered."""
    import signal

    work = tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, "-m", "deploy.cli", "up"]
    up = subprocess.Popen(
        cmd
        + [
            "--run-id",
            "r",
            "--producers",
            "1",
            "--steps",
            "300",
            "--generators",
            "1",
            "--dashboard-port",
            "0",
            "--no-progress",
            "--set",
            f"learner.batch.groups={BATCH}",
            "--set",
            "learner.publish.checkpoint_every=2",
            "--set",
            "broker.eval.every_versions=0",
        ],
        cwd=work,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run_dir = work / "runs" / "r"
    producer_file = run_dir / "secrets" / "producers" / "producer-0.json"
    metrics = run_dir / "learner" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert up.poll() is None and time.monotonic() < deadline, up.communicate()[0][-3000:]
            time.sleep(0.2)
        first, written = json.loads(producer_file.read_text()), producer_file.stat().st_mtime_ns
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=120)
        assert up.returncode == 130, out[-3000:]
        up = subprocess.Popen(
            cmd + ["--resume", "runs/r", "--dashboard-port", "0", "--no-progress"],
            cwd=work,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        steps = metrics.read_text().count("\n")
        while producer_file.stat().st_mtime_ns == written or metrics.read_text().count("\n") < steps + 2:
            assert up.poll() is None and time.monotonic() < deadline + 120, up.communicate()[0][-3000:]
            time.sleep(0.2)
        again = json.loads(producer_file.read_text())  # the same keys and user; the ports may have moved
        assert again["curve"] == first["curve"] and again["redis"]["password"] == first["redis"]["password"]
        r, run_id, pid, address, curve = doc_join()(producer_file)
        latest = msgpack.unpackb(r.get(f"relay:{run_id}:latest"), raw=False)
        sampling = json.loads(r.hget(f"relay:{run_id}:run", "sampling"))
        gid = uuid.uuid4().hex
        payload = build_group(
            group_id=gid,
            run_id=run_id,
            prompt_id="0-1",
            prompt_ids=[1, 7, 14],
            samples=[
                {
                    "completion_ids": [7, 2],
                    "logprobs": [-0.5, -0.5],
                    "versions": [latest["version"]] * 2,
                    "finish_reason": "stop",
                    "reward": 1.0,
                },
                {
                    "completion_ids": [8, 2],
                    "logprobs": [-0.5, -0.5],
                    "versions": [latest["version"]] * 2,
                    "finish_reason": "stop",
                    "reward": 0.0,
                },
            ],
            generator_id=pid,
            weight_version=latest["version"],
            weight_hash=latest["hash"],
            sampling=sampling,
        )
        ack = send_group(address, gid, payload, timeout_s=10.0, give_up_s=60.0, curve=curve)
        assert ack["status"] == "ok", ack
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=120)
        assert up.returncode == 130, out[-3000:]
        assert "1 producer of your own may join as producer-0" in out, out[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
