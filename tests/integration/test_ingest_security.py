"""The ingest as an attacker meets it: a real broker process, a real Redis, real ZeroMQ. A producer
without a listed key, a listed key sending as another generator, a forged weight hash, numbers that
are not finite as float32, a 16 MiB message, a queue full in bytes, a broker started without keys."""

import json
import math
import stat
import sys
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
import redis

from broker.client import queues
from broker.client.sender import GroupSender
from broker.client.telemetry import read_stats
from broker.protocol.group import Sample, encode_group
from broker.protocol.ingest_auth import load_client_keys, write_ingest_keys
from broker.protocol.keys import Keys
from deploy.launcher.procs import free_port
from tests.support.browser import browser  # noqa: F401  (a fixture)
from tests.support.data import MAKE_GROUP_HASH, announce_make_group_versions, make_group
from tests.support.services import announce_key, metric_value, producer_keys, relay, start_broker, start_service


def _keys(tmp_path: Path, *generator_ids: str) -> dict:
    return write_ingest_keys(tmp_path / "keys", list(generator_ids))


def _broker(procs, redis_url, tmp_path, keys: dict, **cfg):
    address, http = start_broker(
        procs,
        redis_url,
        tmp_path,
        ingest_key_file=keys["broker_key_file"],
        ingest_clients_file=keys["clients_file"],
        **cfg,
    )
    r, k = redis.Redis.from_url(redis_url), Keys("r")
    announce_make_group_versions(r, k, announce_key(tmp_path))
    return address, http, r, k


def _sender(address: str, keys: dict, gid: str, **kw) -> GroupSender:
    return GroupSender(
        address,
        timeout_s=kw.pop("timeout_s", 5),
        curve=load_client_keys(keys["generators"][gid], keys["broker_public_key_file"]),
        **kw,
    )


def test_a_producer_without_a_listed_key_is_never_heard(procs, redis_url, tmp_path):
    keys = _keys(tmp_path, "gen-0")
    address, http, r, k = _broker(procs, redis_url, tmp_path, keys)
    stranger = write_ingest_keys(tmp_path / "stranger", ["gen-0"])  # a valid key pair, not in the allow-list
    forged = [(f"forged-{i}", encode_group(make_group(group_id=f"forged-{i}", generator_id="gen-0"))) for i in range(3)]
    for curve in (None, load_client_keys(stranger["generators"]["gen-0"], keys["broker_public_key_file"])):
        attacker = GroupSender(address, timeout_s=1.0, curve=curve)  # plain ZMTP, then an unlisted key
        with pytest.raises(TimeoutError):
            attacker.send_many(forged, give_up_s=3.0)  # no ack at all: not ok, not even rejected
        attacker.close()
    assert r.xlen(k.trajectories) == 0 and r.xlen(k.dead_letter) == 0  # nothing decoded, nothing stored
    assert read_stats(r, k, "broker").get("accepted", 0) == 0
    assert metric_value(httpx.get(f"{http}/metrics").text, "relay_broker_ingest_denied_total") >= 1
    # the listed key gets through the same broker: the refusals above are the key's, not a broken socket
    assert _sender(address, keys, "gen-0").send("real", encode_group(make_group(group_id="real"))).status == "ok"
    assert httpx.get(f"{http}/api/state").json()["ingest_auth"] == "curve"


def test_a_producer_learns_at_once_whether_the_broker_admits_its_key(procs, redis_url, tmp_path):
    """GroupSender.wait_connected: the handshake's outcome, not a silent timeout per group."""
    keys = _keys(tmp_path, "gen-0")
    address, _, _, _ = _broker(procs, redis_url, tmp_path, keys)
    stranger = write_ingest_keys(tmp_path / "stranger", ["gen-0"])
    refused = GroupSender(
        address, curve=load_client_keys(stranger["generators"]["gen-0"], keys["broker_public_key_file"])
    )
    with pytest.raises(PermissionError, match="refused this producer's key"):
        refused.wait_connected(timeout_s=10)
    refused.close()
    plain = GroupSender(address)  # no CURVE against a CURVE broker
    with pytest.raises(ConnectionError, match="does ingest_auth match"):
        plain.wait_connected(timeout_s=10)
    plain.close()
    listed = _sender(address, keys, "gen-0")
    listed.wait_connected(timeout_s=10)
    assert listed.send("after-wait", encode_group(make_group(group_id="after-wait"))).status == "ok"
    listed.close()
    with pytest.raises(TimeoutError, match="no handshake"):  # nothing listening there
        GroupSender(f"tcp://127.0.0.1:{free_port()}").wait_connected(timeout_s=1)


def test_a_generator_whose_key_the_broker_refuses_stops_at_once_with_the_reason(procs, redis_url, tmp_path):
    keys = _keys(tmp_path, "gen-0")
    address, _, _, _ = _broker(procs, redis_url, tmp_path, keys)
    stranger = write_ingest_keys(tmp_path / "stranger", ["gen-0"])  # a valid key pair, not in the allow-list
    gen = start_service(
        procs,
        "gen",
        "generator",
        {
            "id": "gen-0",
            "run_id": "r",
            "redis_url": redis_url,
            "broker_address": address,
            "reward_url": "http://127.0.0.1:9/score",
            "backend": {"type": "simulated"},
            "ingest_key_file": stranger["generators"]["gen-0"],
            "broker_public_key_file": keys["broker_public_key_file"],
        },
        tmp_path,
    )
    assert gen.proc.wait(60) == 2, gen.tail()
    assert "the broker's ingest refuses this generator" in gen.log_path.read_text()
    assert "refused this producer's key" in gen.log_path.read_text()


def test_a_listed_key_cannot_send_as_another_generator(procs, redis_url, tmp_path):
    keys = _keys(tmp_path, "gen-0", "gen-1")
    address, _, r, k = _broker(procs, redis_url, tmp_path, keys)
    gen1 = _sender(address, keys, "gen-1")
    ack = gen1.send("spoof", encode_group(make_group(group_id="spoof", generator_id="gen-0")))
    assert ack.status == "rejected" and ack.reason == "wrong_generator"
    assert gen1.send("own", encode_group(make_group(group_id="own", generator_id="gen-1"))).status == "ok"
    assert read_stats(r, k, "broker")["rejected:wrong_generator"] == 1
    assert [f[b"reason"] for _, f in r.xrange(k.dead_letter)] == [b"wrong_generator"]
    assert [f[b"gen"] for _, f in r.xrange(k.trajectories)] == [b"gen-1"]


def test_forged_hashes_and_numbers_that_are_not_finite_as_float32_are_rejected(procs, redis_url, tmp_path):
    address, _ = start_broker(procs, redis_url, tmp_path)
    r, k = redis.Redis.from_url(redis_url), Keys("r")
    announce_make_group_versions(r, k, announce_key(tmp_path))
    sender = GroupSender(address, timeout_s=5, curve=producer_keys(tmp_path))
    forged = sender.send("h", encode_group(make_group(group_id="h", weight_hash="cd" * 32)))
    assert (forged.status, forged.reason) == ("rejected", "weight_hash")
    unannounced = sender.send(
        "u", encode_group(make_group(group_id="u", weight_version=2, weight_hash=MAKE_GROUP_HASH))
    )
    assert (unannounced.status, unannounced.reason) == ("rejected", "weight_hash")
    g = make_group(group_id="big")
    g.samples[0].reward = 1e300  # finite as float64, inf as float32: NaN advantages for the whole batch
    assert sender.send("big", encode_group(g)).reason == "non_finite"
    g = make_group(group_id="huge-reward")
    g.samples[0].reward = 3e38  # finite as float32, but its square is not: refused by the documented bound
    assert sender.send("huge-reward", encode_group(g)).reason == "reward_range"
    g = make_group(group_id="nan")
    g.samples[0].logprobs = np.array([-0.5, math.nan, -0.1], np.float32)
    assert sender.send("nan", encode_group(g)).reason == "non_finite"
    assert sender.send("fine", encode_group(make_group(group_id="fine"))).status == "ok"
    stats = read_stats(r, k, "broker")
    assert stats["rejected:weight_hash"] == 2 and stats["rejected:non_finite"] == 2 and stats["accepted"] == 1
    assert stats["rejected:reward_range"] == 1
    assert [f[b"gid"] for _, f in r.xrange(k.trajectories)] == [b"fine"]


def _vm(pid: int, field: str) -> int:
    """A memory figure of /proc/<pid>/status, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _message_of(nbytes: int, group_id: str = "huge") -> bytes:
    """A valid group of one sample whose token arrays make it just under ``nbytes``."""
    tokens = (nbytes - 4096) // 8
    g = make_group(
        group_id=group_id,
        samples=[Sample(np.zeros(tokens, np.int32), np.full(tokens, -0.5, np.float32), [[3, tokens]], "stop", 1.0)],
    )
    return encode_group(g)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_16_mib_message_grows_the_broker_by_less_than_4x_its_size(procs, redis_url, tmp_path):
    address, _ = start_broker(procs, redis_url, tmp_path)
    r, k = redis.Redis.from_url(redis_url), Keys("r")
    announce_make_group_versions(r, k, announce_key(tmp_path))
    pid = next(c for c in procs.children if c.name == "broker").proc.pid
    sender = GroupSender(address, timeout_s=30, curve=producer_keys(tmp_path))
    assert sender.send("warm", encode_group(make_group(group_id="warm"))).status == "ok"  # sockets and scripts warm
    limit = 16 << 20
    message = _message_of(limit)
    assert limit - 8192 < len(message) <= limit
    # many empty maps: the shape that made 16 MiB cost gigabytes (refused, within the same bound)
    bomb = msgpack.packb({"schema": 1, "kind": "group", "group_id": "bomb", "x": [[{}] * 4096] * 4090})
    assert limit - (1 << 20) < len(bomb) <= limit
    for payload, gid, expect in ((message, "huge", ("ok", "")), (bomb, "bomb", ("rejected", "too_complex"))):
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
        before = _vm(pid, "VmRSS")
        ack = sender.send(gid, payload, give_up_s=60)
        assert (ack.status, ack.reason) == expect
        growth = _vm(pid, "VmHWM") - before
        assert growth < 4 * len(payload), (
            f"{gid}: peak grew {growth / 2**20:.0f} MiB for {len(payload) / 2**20:.0f} MiB"
        )


def test_the_queue_bound_in_bytes_answers_busy(procs, redis_url, tmp_path):
    address, http = start_broker(procs, redis_url, tmp_path, max_queue_bytes=1 << 20)
    r, k = redis.Redis.from_url(redis_url), Keys("r")
    announce_make_group_versions(r, k, announce_key(tmp_path))
    sender = GroupSender(address, timeout_s=5, curve=producer_keys(tmp_path))
    # 400 KiB groups: two fit in 1 MiB, a third would pass it (far below max_queue_groups = 256)
    assert [sender.send(f"g{i}", _message_of(400 << 10, f"g{i}")).status for i in range(2)] == ["ok", "ok"]
    with pytest.raises(TimeoutError):
        sender.send("g2", _message_of(400 << 10, "g2"), give_up_s=1.5)
    assert sender.busy_waits > 0 and r.xlen(k.trajectories) == 2
    assert read_stats(r, k, "broker")["busy"] >= 1
    assert 2 * (400 << 10) - 8192 < httpx.get(f"{http}/api/state").json()["queue_bytes"] <= 1 << 20
    # the learner commits one group: its bytes are given back, and the waiting group gets in
    eid, fields = r.xrange(k.trajectories, count=1)[0]
    queues.commit(r, k, [(eid.decode(), fields[b"gid"].decode())], step=1)
    assert sender.send("g2", _message_of(400 << 10, "g2")).status == "ok"
    assert queues.queued_bytes(r, k) == sum(int(n) for n in r.hvals(k.queue_sizes)) < 1 << 20


def test_a_broker_without_its_keys_refuses_to_start_and_says_how_to_fix_it(procs, redis_url, tmp_path):
    cfg = {
        "run_id": "r",
        "redis_url": redis_url,
        "ingest_bind": f"tcp://127.0.0.1:{free_port()}",
        "http_port": free_port(),
        "ingest_auth": "curve",
        "ingest_key_file": str(tmp_path / "nope.key_secret"),
        "ingest_clients_file": str(tmp_path / "clients.json"),
    }
    child = start_service(procs, "broker", "broker", cfg, tmp_path)
    assert child.proc.wait(timeout=60) != 0
    log = child.tail(20)
    assert "ingest_key_file" in log and "write_ingest_keys" in log and 'ingest_auth = "insecure"' in log
    assert "Traceback" not in log


def test_an_insecure_ingest_is_shown_on_the_dashboard(procs, redis_url, tmp_path, browser):  # noqa: F811
    _, http = start_broker(procs, redis_url, tmp_path, ingest_auth="insecure")
    assert httpx.get(f"{http}/api/state").json()["ingest_auth"] == "insecure"
    assert metric_value(httpx.get(f"{http}/metrics").text, "relay_broker_ingest_insecure") == 1
    page = browser.new_page()
    page.goto(http + "/")
    badge = page.locator("#ingest-insecure")
    badge.wait_for(state="visible", timeout=30_000)
    assert badge.inner_text() == "ingest: insecure"
    # the same page for an authenticated ingest: no badge (the advertisement is what the page reads)
    redis.Redis.from_url(redis_url).hset(Keys("r").run, "ingest_auth", "curve")
    badge.wait_for(state="hidden", timeout=30_000)


@pytest.mark.slow  # a run of several services: left to `make test` (docs/testing.md)
def test_relay_up_runs_with_per_run_keys_and_private_config_files(tmp_path):
    res = relay(
        "up",
        "--steps",
        "3",
        "--generators",
        "2",
        "--runs-dir",
        str(tmp_path),
        "--run-id",
        "k",
        "--dashboard-port",
        "0",
        "--no-progress",
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    run = tmp_path / "k"
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 3 and s["groups_rejected"] == 0 and set(s["generators"]) == {"gen-0", "gen-1"}
    keydir = run / "secrets" / "ingest"
    assert stat.S_IMODE(keydir.stat().st_mode) == 0o700
    assert {p.name for p in keydir.iterdir()} >= {
        "broker.key_secret",
        "clients.json",
        "generator-gen-0.key_secret",
        "generator-gen-1.key_secret",
    }
    files = [*keydir.iterdir(), *(run / "config").iterdir()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), files
    broker = json.loads((run / "config" / "broker.json").read_text())
    gen1 = json.loads((run / "config" / "generator-1.json").read_text())
    assert broker.get("ingest_auth", "curve") == "curve" == gen1["ingest_auth"]  # the default, on
    assert gen1["ingest_key_file"].endswith("generator-gen-1.key_secret")
    allow = json.loads((keydir / "clients.json").read_text())["clients"]
    assert sorted(c["generator_id"] for c in allow) == ["gen-0", "gen-1"]  # each key bound to one id
