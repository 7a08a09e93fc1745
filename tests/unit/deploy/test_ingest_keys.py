"""relay up's ingest keys (deploy/launcher/ingest_keys.py) and its producers of the user's own
(deploy/launcher/producers.py): only the keys the configs use are written, the keys the configs name
are checked to fit together before anything starts, and each producer gets a key bound to its id, a
Redis user with the generator's rights, and one file saying where everything is."""

import json
import stat

import pytest

from broker.protocol.ingest_auth import IngestAuthError, load_allow_list, write_ingest_keys
from deploy.launcher.ingest_keys import check_ingest_keys, ingest_key_dir, write_run_ingest_keys
from deploy.launcher.producers import producer_ids, write_connection_files
from deploy.launcher.redis_acl import acl_permissions
from deploy.launcher.run_secrets import RedisUsers


def run_configs(run_dir, **over):
    d = ingest_key_dir(run_dir)
    broker = {
        "ingest_key_file": str(d / "broker.key_secret"),
        "ingest_clients_file": str(d / "clients.json"),
        **over.get("broker", {}),
    }
    generator = {"broker_public_key_file": str(d / "broker.key"), **over.get("generator", {})}
    return broker, generator


def own_keys(tmp_path):
    """A key set of the user's own: one key for every generator (gen-*) and one producer key (mine-0)."""
    k = write_ingest_keys(tmp_path / "own", ["pool", "mine-0"], patterns={"pool": "gen-*"})
    return {
        "broker": {"ingest_key_file": k["broker_key_file"], "ingest_clients_file": k["clients_file"]},
        "generator": {
            "ingest_key_file": k["generators"]["pool"],
            "broker_public_key_file": k["broker_public_key_file"],
        },
    }


def test_the_run_set_holds_each_generator_and_producer_key_bound_to_its_id(tmp_path):
    broker, generator = run_configs(tmp_path)
    gens = write_run_ingest_keys(tmp_path, broker, generator, ["gen-0", "gen-1"], ["producer-0"])
    d = ingest_key_dir(tmp_path)
    assert gens == {g: str(d / f"generator-{g}.key_secret") for g in ("gen-0", "gen-1")}
    allow = load_allow_list(broker["ingest_clients_file"])
    producer = (d / "producer-0.key").read_text()
    key = next(k for k in allow.patterns if k in producer)
    assert allow.allows(key, "producer-0") and not allow.allows(key, "producer-1") and not allow.allows(key, "gen-0")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in d.iterdir())
    before = broker_text = (d / "clients.json").read_text()
    write_run_ingest_keys(tmp_path, broker, generator, ["gen-0", "gen-1"], ["producer-0"])  # a resume: kept
    assert (d / "clients.json").read_text() == before == broker_text
    check_ingest_keys(tmp_path, broker, generator, ["gen-0", "gen-1"])


def test_a_run_with_keys_of_its_own_gets_no_unused_key_set(tmp_path):
    """Before, relay up wrote secrets/ingest/ (a broker key, a key per generator, an allow-list) that nothing used."""
    broker, generator = run_configs(tmp_path / "run", **own_keys(tmp_path))
    assert write_run_ingest_keys(tmp_path / "run", broker, generator, ["gen-0", "gen-1"], []) == {}
    assert not ingest_key_dir(tmp_path / "run").exists()
    check_ingest_keys(tmp_path / "run", broker, generator, ["gen-0", "gen-1"])


@pytest.mark.parametrize(
    "keep, says",
    [
        (("broker",), "only broker.ingest_key_file is your own"),
        (("generator.broker_public_key_file",), "only generator.broker_public_key_file is your own"),
        (("broker.ingest_clients_file",), "only broker.ingest_clients_file is your own"),
        (("generator.ingest_key_file",), "only generator.ingest_key_file is your own"),
    ],
)
def test_half_of_a_pair_of_ones_own_is_refused_before_start(tmp_path, keep, says):
    own = own_keys(tmp_path)
    over = {"broker": {}, "generator": {}}
    for field in keep:
        service, _, name = field.partition(".")
        over[service] = {k: v for k, v in own[service].items() if not name or k == name}
        if service == "broker" and not name:
            over[service] = {"ingest_key_file": own["broker"]["ingest_key_file"]}
    broker, generator = run_configs(tmp_path / "run", **over)
    with pytest.raises(IngestAuthError, match=says):
        check_ingest_keys(tmp_path / "run", broker, generator, ["gen-0"])


def test_own_keys_that_do_not_fit_are_refused_naming_the_fields(tmp_path):
    own = own_keys(tmp_path)
    other = write_ingest_keys(tmp_path / "other", ["x"])
    broker, generator = run_configs(
        tmp_path / "run",
        broker=own["broker"],
        generator={**own["generator"], "broker_public_key_file": other["broker_public_key_file"]},
    )
    with pytest.raises(IngestAuthError, match="is not the public key of broker.ingest_key_file"):
        check_ingest_keys(tmp_path / "run", broker, generator, ["gen-0"])
    broker, generator = run_configs(
        tmp_path / "run",
        broker=own["broker"],
        generator={**own["generator"], "ingest_key_file": str(tmp_path / "own" / "generator-mine-0.key_secret")},
    )
    with pytest.raises(IngestAuthError, match="not admitted for generator id 'gen-0'.*binds that key to 'mine-0'"):
        check_ingest_keys(tmp_path / "run", broker, generator, ["gen-0"])
    broker, generator = run_configs(tmp_path / "run", **own)
    with pytest.raises(IngestAuthError, match="your own: add your producers' keys to it"):
        write_run_ingest_keys(tmp_path / "run", broker, generator, ["gen-0"], ["producer-0"])


def test_a_producer_has_a_redis_user_with_the_generators_rights_and_its_file_says_where_everything_is(tmp_path):
    ids = producer_ids(2)
    assert ids == ["producer-0", "producer-1"]
    assert acl_permissions("r", "producer-1") == acl_permissions("r", "generator")
    users = RedisUsers.new("r", ids)
    users.write(tmp_path)
    again = RedisUsers.read(tmp_path, "r")  # a resume keeps the producers' users and passwords
    assert again.passwords == users.passwords and again.producers() == ids
    acl = (tmp_path / "secrets" / "redis" / "users.acl").read_text()
    assert acl.count("user producer-") == 2
    broker, generator = run_configs(tmp_path)
    generator.update(broker_address="tcp://127.0.0.1:5555,tcp://127.0.0.1:5556", weight_store="/w")
    write_run_ingest_keys(tmp_path, broker, generator, ["gen-0"], ids)
    paths = write_connection_files(
        tmp_path, "r", ids, broker, generator, "http://127.0.0.1:1", users, users.url("launcher", 6390)
    )
    info = json.loads(paths[1].read_text())
    assert stat.S_IMODE(paths[1].stat().st_mode) == 0o600
    assert stat.S_IMODE(paths[1].parent.stat().st_mode) == 0o700
    assert info["generator_id"] == "producer-1" and info["run_id"] == "r"
    assert info["ingest_addresses"] == ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"]
    assert info["redis"] == {
        "url": users.url("producer-1", 6390),
        "host": "127.0.0.1",
        "port": 6390,
        "user": "producer-1",
        "password": users.passwords["producer-1"],
    }
    d = ingest_key_dir(tmp_path)
    assert info["curve"]["public_key"] in (d / "producer-1.key").read_text()
    assert info["curve"]["secret_key"] in (d / "producer-1.key_secret").read_text()
    assert info["curve"]["broker_public_key"] in (d / "broker.key").read_text()
    assert load_allow_list(broker["ingest_clients_file"]).allows(info["curve"]["public_key"], "producer-1")


def test_with_a_redis_of_ones_own_the_producers_file_gives_its_address_without_credentials(tmp_path):
    broker, generator = run_configs(tmp_path)
    generator.update(broker_address="tcp://127.0.0.1:5555")
    write_run_ingest_keys(tmp_path, broker, generator, ["gen-0"], ["producer-0"])
    [path] = write_connection_files(
        tmp_path, "r", ["producer-0"], broker, generator, "", None, "redis://admin:s3cret@db.example:6400/0"
    )
    info = json.loads(path.read_text())
    assert info["redis"] == {
        "url": "redis://db.example:6400/0",
        "host": "db.example",
        "port": 6400,
        "user": None,
        "password": None,
    }
    assert "s3cret" not in path.read_text()
