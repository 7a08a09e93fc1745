"""`relay up --set weights.transport=http` at tiny size: the generators get no weight store path, fetch every
version they apply from the learner's weight server over HTTP into their own caches, and apply only what
was announced (real redis-server, broker, reward service, two torch generators, the DeepSpeed learner)."""

import json
import re

import pytest

from broker.client.announcements import latest_announcement
from broker.client.connection import connect_redis
from broker.client.telemetry import read_events
from broker.protocol.keys import Keys
from tests.support.services import relay, relay_up_args


@pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)
def test_relay_up_with_the_http_transport_shares_no_folder(tmp_path, redis_url):
    res = relay(
        *relay_up_args(
            tmp_path,
            "http",
            "--redis-url",
            redis_url,
            steps=40,
            sets=("weights.transport=http",),
        ),
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = tmp_path / "http"
    learner = json.loads((run / "config" / "learner.json").read_text())
    assert learner["weights"]["transport"]["type"] == "http" and learner["weights"]["transport"]["port"] > 0
    gens = {}
    for i in (0, 1):
        cfg = json.loads((run / "config" / f"generator-{i}.json").read_text())
        assert cfg["weights"]["transport"] == learner["weights"]["transport"]  # the learner's fixed port
        assert cfg["weight_store"] == ""  # no shared folder given
        gens[cfg["id"]] = cfg

    r, keys = connect_redis(redis_url), Keys("http")
    last = latest_announcement(r, keys)  # unsigned check: the URL the generators were sent to
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v000040/", last.url), last.url
    events = [e for _, e in read_events(r, keys, None, 100_000)]
    published = {e.data["version"]: e.data for e in events if e.kind == "published"}
    assert sorted(published) == list(range(41))  # the initial version and one per step
    assert not [e.data for e in events if e.kind == "refused"]
    for gid in gens:
        applied = [e.data for e in events if e.kind == "applied" and e.data["generator"] == gid]
        assert len({a["version"] for a in applied}) >= 10, (gid, len(applied))
        for a in applied:  # the tensors' digest, where the applied event carries it, is the announced one
            if a.get("digest"):
                assert a["digest"] == published[a["version"]]["digest"], a
        log = (run / "logs" / f"{gid}.log").read_text()
        fetched = {int(v) for v in re.findall(r"fetched version (\d+) over http", log)}
        served = {int(v): h for v, h in re.findall(r"serving version (\d+) \((\w+)\)", log)}
        assert {a["version"] for a in applied} == set(served) <= fetched  # every version applied came over HTTP
        assert max(served) == 40  # the learner served until the generators had its last version
        for v, h in served.items():  # the manifest hash served is the one announced
            assert published[v]["hash"].startswith(h), (gid, v)
