"""A forged weight announcement, written straight into Redis by someone who can write there but has not
the run's announcement key (docs/security.md, "Redis and announcements"): a running generator never loads
it, the dashboard flags it, the broker's version checks ignore it."""

import httpx
import pytest
import redis
import torch

from broker.client.announcements import announce, latest_announcement
from broker.client.telemetry import read_heartbeats, read_stats
from broker.config import BrokerConfig
from broker.protocol import signing
from broker.protocol.group import encode_group
from broker.protocol.keys import Keys
from broker.protocol.messages import Announcement, encode_announcement
from broker.service import Broker
from learner.publish import Publisher
from learner.tiny_model import build_tiny_model
from tests.support.browser import browser  # noqa: F401  (a fixture)
from tests.support.data import make_group
from tests.support.services import (
    RecordingBackend,
    announce_key,
    announce_public_key_file,
    generator_cfg,
    start_broker_and_reward,
    start_service,
    wait_until,
)


def _forge(r, keys, a: Announcement) -> None:
    """What an attacker with Redis access writes: the announcement where the learner writes its own."""
    data = encode_announcement(a)
    r.set(keys.latest, data)
    r.hset(keys.versions, str(a.version), data)
    r.publish(keys.announce, data)


@pytest.mark.slow  # a generator process with a model: like the other generator tests, left to `make test`
def test_a_running_generator_never_loads_a_forged_announcement_and_the_dashboard_flags_it(
    procs, redis_url, tmp_path, request
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    svc = start_broker_and_reward(
        procs, redis_url, tmp_path, "forge", prompt_backlog=8, max_queue_groups=100_000, eval={"every_versions": 0}
    )
    r, keys = redis.Redis.from_url(redis_url), Keys("forge")
    path = build_tiny_model(tmp_path / "model")
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    learner = Publisher(r, keys, str(tmp_path / "weights"), tok, keep_versions=10, announce_key=announce_key(tmp_path))
    a0 = learner.publish(model, model.state_dict(), 0)
    gen = start_service(
        procs,
        "gen",
        "generator",
        generator_cfg(
            svc,
            redis_url,
            "forge",
            "g0",
            prompts_per_batch=2,
            sampling={"n": 2, "max_tokens": 4},
            weight_store=str(tmp_path / "weights"),
        ),
        tmp_path,
    )

    def heartbeat():
        return read_heartbeats(r, keys).get("g0")

    wait_until(lambda: (hb := heartbeat()) and hb.version == 0, timeout=60, what=f"version 0 served:\n{gen.tail()}")

    # the attacker's own weights: a valid snapshot (correct manifest and hash) in a folder of their own,
    # announced as a much newer version, unsigned
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.01)
    evil = Publisher(r, keys, str(tmp_path / "attacker"), tok, keep_versions=10)  # no key: unsigned
    forged = evil.publish(model, model.state_dict(), 99)
    _forge(r, keys, forged)
    hb = wait_until(
        lambda: (h := heartbeat()) and h.forged_announcements >= 1 and h,
        timeout=60,
        what=f"the forged announcement noticed:\n{gen.tail()}",
    )
    # and one signed with a key that is not the run's
    other = signing.signed(signing.AnnounceSigner.generate(), "forge", Announcement(100, forged.hash, forged.path))
    _forge(r, keys, other)
    hb = wait_until(
        lambda: (h := heartbeat()) and h.forged_announcements >= 2 and h,
        timeout=60,
        what=f"the second forgery noticed:\n{gen.tail()}",
    )
    assert hb.version == 0 and hb.hash == a0.hash and hb.updates == 1 and gen.alive()
    assert hb.refused.get(forged.hash) in ("unsigned", "bad_signature")
    assert "ignored a forged weight announcement" in gen.tail(200)
    assert latest_announcement(r, keys, announce_key(tmp_path)).version == 0  # the newest signed one

    st = httpx.get(f"{svc.http}/api/state", timeout=10).json()
    assert st["flags"]["forged_announcement"]["reason"] == "bad_signature"
    assert st["flags"]["forged_announcement"]["version"] == 100 and st["flags"]["forged_seen"] == ["g0"]
    assert st["learner_version"] == 0 and st["learner_hash"] == a0.hash  # the real learner's, not the forger's
    assert st["failures"]["forged_announcements"] >= 2
    assert [g["version"] for g in st["generators"]] == [0]
    page_checked = _check_page(request, svc.http)

    # the learner's next version is loaded as usual
    a1 = learner.publish(
        AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).state_dict(), 1
    )
    wait_until(
        lambda: (h := heartbeat()) and h.version == 1 and h.hash == a1.hash,
        timeout=60,
        what=f"version 1 served:\n{gen.tail()}",
    )
    assert httpx.get(f"{svc.http}/api/state", timeout=10).json()["flags"]["forged_announcement"] is None
    if not page_checked:
        pytest.skip("the API flags were checked; the page was not (no browser, see the reason above)")


def _check_page(request, url: str) -> bool:
    """The dashboard shows the forgery in red: an alert, and the generator's row. False when there is no browser."""
    from tests.support.browser import chromium_or_skip

    try:
        chromium_or_skip()
    except pytest.skip.Exception as e:  # keep going with the API checks; the test reports the skip at the end
        print(f"page not checked: {e}")
        return False
    page = request.getfixturevalue("browser").new_page(viewport={"width": 1400, "height": 900})
    page.goto(url + "/")
    page.wait_for_function(
        "document.querySelector('#alerts')?.innerText.includes('forged weight announcement')", timeout=30_000
    )
    assert "bad_signature" in page.inner_text("#alerts") and "g0 ignored 2 forged" in page.inner_text("#alerts")
    assert "hash-mismatch" in page.locator('#generators tr[data-id="g0"]').get_attribute("class")
    page.close()
    return True


def test_a_forged_version_does_not_drive_the_brokers_version_checks(redis_url, tmp_path):
    b = Broker(
        BrokerConfig(
            run_id="r",
            redis_url=redis_url,
            http_port=0,
            ingest_auth="insecure",
            announce_public_key_file=str(announce_public_key_file(tmp_path)),
        )
    )
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    announce(r, keys, Announcement(version=2, hash="ab" * 32, path="/x"), announce_key(tmp_path))
    _forge(r, keys, Announcement(version=10**9, hash="cd" * 32, path="/attacker"))
    b.ingest._read_latest()
    ack = b.ingest.handle(encode_group(make_group(group_id="ahead")))  # its newest token version is 4
    assert ack.status == "rejected" and ack.reason == "version_ahead"  # ahead of 2, the newest signed version
    assert read_stats(r, keys, "broker")["rejected:version_ahead"] == 1


def test_a_service_without_its_key_file_does_not_start(procs, redis_url, tmp_path):
    gen = start_service(
        procs,
        "gen",
        "generator",
        {"run_id": "nokey", "redis_url": redis_url, "announce_public_key_file": str(tmp_path / "missing.pub")},
        tmp_path,
    )
    assert gen.proc.wait(60) == 2
    assert "cannot read the announcement public key" in gen.tail()


def test_a_forgery_that_copies_a_real_hash_neither_loads_nor_blocks_the_real_version(redis_url, tmp_path):
    """The attacker replays the hash the learner announced, with a folder of their own: the generator loads
    the learner's folder, and still loads that hash when the learner's signed announcement stands."""
    from generators.weights import WeightApplier
    from tests.support.data import snapshot

    r, keys, key = redis.Redis.from_url(redis_url), Keys("copy"), announce_key(tmp_path)
    store = tmp_path / "store"
    p1, h1 = snapshot(store, 1)
    announce(r, keys, Announcement(1, h1, str(p1)), key)
    backend = RecordingBackend()
    w = WeightApplier(r, keys, backend, "g", announce_key=key, store=str(store))
    w.update(block=True)
    p2, h2 = snapshot(store, 2, b"v2 weights")
    real = signing.signed(key, "copy", Announcement(2, h2, str(p2)))
    r.hset(keys.versions, "2", encode_announcement(real))  # the learner's record of version 2...
    evil_path, _ = snapshot(tmp_path / "evil", 2, b"v2 weights")
    r.set(keys.latest, encode_announcement(Announcement(2, h2, str(evil_path))))  # ...the attacker's latest, same hash
    w.update()
    assert w.version == 2 and backend.loaded == [str(p1), str(p2)] and w.forged_announcements == 1
    assert w.refused == {h2: "unsigned"} and w.refused_updates == 0
    # a version outside the store, even signed (a stolen key), is refused as a bad snapshot
    p3, h3 = snapshot(tmp_path / "elsewhere", 3)
    announce(r, keys, Announcement(3, h3, str(p3)), key)
    w.update()
    assert w.version == 2 and w.refused[h3] == "outside_store" and w.refused_updates == 1


def _what_a_generator_holds(tmp_path):
    """Every secret of a `relay up` run that a generator's config names (what whoever steals one generator's files
    has), each as bytes, and the learner's signing key."""
    from pathlib import Path

    from broker.protocol.ingest_auth import write_ingest_keys
    from deploy.launcher.run_secrets import announce_key_path, run_key_fields, write_run_keys

    run = tmp_path / "run"
    write_run_keys(run)
    mine = run_key_fields(run)["generator"]
    ingest = write_ingest_keys(run / "secrets" / "ingest", ["gen-0"])
    files = [
        mine["announce_public_key_file"],
        mine["weights"]["key_file"],
        ingest["generators"]["gen-0"],
        ingest["broker_public_key_file"],
    ]
    return (
        {Path(f).name: Path(f).read_bytes() for f in files},
        signing.read_signer(announce_key_path(run)),
        mine["announce_public_key_file"],
    )


def _signatures_from(secret: bytes, run_id: str, a: Announcement) -> list[str]:
    """Every way the secret could sign ``a``: as the HMAC key announcements were signed with before (over the old and
    the new canonical bytes), and as an Ed25519 private key (the secret itself when it is 32 bytes in hex, or its
    hash)."""
    import hashlib
    import hmac

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    text = secret.strip()
    try:
        raw = bytes.fromhex(text.decode())
    except ValueError:
        raw = text
    message = signing.canonical_bytes(run_id, a)
    old = message.replace(b"17:relay-announce-v2,", b"17:relay-announce-v1,")
    sigs = [hmac.new(k, m, hashlib.sha256).hexdigest() for k in (raw, text) for m in (message, old)]
    for seed in {raw[:32].ljust(32, b"\0"), hashlib.sha256(text).digest()}:
        sigs.append(Ed25519PrivateKey.from_private_bytes(seed).sign(message).hex())
    return sigs


def test_an_announcement_signed_with_a_generators_secrets_is_refused_by_the_generators_and_the_broker(
    redis_url, tmp_path
):
    """The theft the HMAC key allowed: every secret one generator holds, used to sign a version of the thief's
    (a huge version naming a folder of theirs). A generator does not load it, the broker does not take it for the
    latest version (groups claiming it are refused) and keeps accepting the learner's."""
    from generators.weights import WeightApplier
    from tests.support.data import MAKE_GROUP_HASH, snapshot

    held, learner_key, public_file = _what_a_generator_holds(tmp_path)
    public = signing.read_verifier(public_file)
    r, keys = redis.Redis.from_url(redis_url), Keys("r")
    store = tmp_path / "store"
    p4, h4 = snapshot(store, 4)
    announce(r, keys, Announcement(3, MAKE_GROUP_HASH, "/weights/v3"), learner_key)
    announce(r, keys, Announcement(4, h4, str(p4)), learner_key)
    backend = RecordingBackend()
    w = WeightApplier(r, keys, backend, "gen-0", announce_key=public, store=str(store))
    w.update(block=True)
    assert w.version == 4
    b = Broker(
        BrokerConfig(
            run_id="r", redis_url=redis_url, http_port=0, ingest_auth="insecure", announce_public_key_file=public_file
        )
    )
    evil_path, evil_hash = snapshot(store, 10**9, b"the thief's weights")  # even inside the store
    forged, sigs = 0, set()
    for name, secret in held.items():
        for sig in _signatures_from(secret, "r", Announcement(10**9, evil_hash, str(evil_path), published_at=1.0)):
            _forge(r, keys, Announcement(10**9, evil_hash, str(evil_path), published_at=1.0, sig=sig))
            forged, _ = forged + 1, sigs.add(sig)
            w.update()
            assert w.version == 4, f"a generator loaded a version signed with {name}"
            assert latest_announcement(r, keys, public).version == 4, name
            b.ingest._read_latest()
            thief = make_group(group_id=f"thief-{forged}", weight_version=10**9, weight_hash=evil_hash)
            for s in thief.samples:
                s.version_runs = [[10**9, sum(n for _, n in s.version_runs)]]
            ack = b.ingest.handle(encode_group(thief))
            assert (ack.status, ack.reason) == ("rejected", "version_ahead"), name
    assert backend.loaded == [str(p4)] and w.forged_announcements == len(sigs) > 10  # each seen, counted once
    announce(r, keys, Announcement(4, h4, str(p4)), learner_key)  # the learner's own are still taken
    for s in (g := make_group(group_id="honest")).samples:
        s.version_runs = [[3, sum(n for _, n in s.version_runs)]]
    assert b.ingest.handle(encode_group(g)).status == "ok"
