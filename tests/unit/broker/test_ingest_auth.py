"""Ingest keys: what write_ingest_keys writes, and the errors a wrong file gives at start-up."""

import json
import stat

import pytest

from broker.protocol.ingest_auth import (
    IngestAuthError,
    load_allow_list,
    load_client_keys,
    load_server_keys,
    write_ingest_keys,
)
from generators.config import GeneratorConfig
from generators.sink import sender_keys


def test_keys_are_private_and_each_generator_is_bound_to_exactly_its_id(tmp_path):
    paths = write_ingest_keys(tmp_path / "k", ["gen-0", "gen-[1]"])
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in (tmp_path / "k").iterdir())
    allow = load_allow_list(paths["clients_file"])
    key0 = load_client_keys(paths["generators"]["gen-0"], paths["broker_public_key_file"])
    key1 = load_client_keys(paths["generators"]["gen-[1]"], paths["broker_public_key_file"])
    assert key0.server == load_server_keys(paths["broker_key_file"])[0]
    assert allow.allows(key0.public.decode(), "gen-0") and not allow.allows(key0.public.decode(), "gen-00")
    assert allow.allows(key1.public.decode(), "gen-[1]") and not allow.allows(key1.public.decode(), "gen-1")
    assert not allow.allows_key("x" * 40)


def test_a_pattern_lets_one_key_speak_for_several_ids(tmp_path):
    paths = write_ingest_keys(tmp_path, ["pool"], patterns={"pool": "gen-*"})
    allow = load_allow_list(paths["clients_file"])
    public = json.loads((tmp_path / "clients.json").read_text())["clients"][0]["public_key"]
    assert allow.allows(public, "gen-7") and not allow.allows(public, "other")


def test_missing_and_wrong_files_name_the_field_and_the_way_out(tmp_path):
    paths = write_ingest_keys(tmp_path, ["gen-0"])
    with pytest.raises(IngestAuthError, match="ingest_key_file is not set.*insecure"):
        load_server_keys("")
    with pytest.raises(IngestAuthError, match="ingest_key_file.*no secret key"):
        load_server_keys(paths["broker_public_key_file"])  # the public half only
    with pytest.raises(IngestAuthError, match="broker_public_key_file.*not a readable"):
        load_client_keys(paths["generators"]["gen-0"], str(tmp_path / "nope.key"))
    (tmp_path / "bad.json").write_text('{"clients": [{"public_key": "short", "generator_id": "g"}]}')
    with pytest.raises(IngestAuthError, match=r"clients\[0\]"):
        load_allow_list(str(tmp_path / "bad.json"))
    # a generator fails before it loads a model: its keys are read first
    with pytest.raises(IngestAuthError, match="ingest_key_file"):
        sender_keys(GeneratorConfig(id="gen-0"))
    assert sender_keys(GeneratorConfig(id="gen-0", ingest_auth="insecure")) is None
