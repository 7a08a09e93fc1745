"""``weights.transport``: one section chosen by its ``type`` (broker/protocol/weights_config.py). The type alone
(``--set weights.transport=http``) is its short spelling, with no warning; the old ``[weights.http]`` and
``[weights.collective]`` sections keep working with one warning each, moved into ``weights.transport`` when the
transport is theirs, in a file, a variable, ``--set``, ``relay up`` and a recorded run (docs/config.md,
"Renamed keys")."""

import logging

import pytest

from broker.protocol.weights_config import CollectiveTransport, HttpTransport, IpcTransport, StoreTransport
from broker.runtime import config as runtime_config
from broker.runtime.config import ConfigError, load_config, set_overrides
from deploy.launcher import environment
from generators.config import GeneratorConfig
from learner.config import LearnerConfig
from tests.support.up_plan import plan_up


@pytest.fixture(autouse=True)
def _warn_again():
    """Each test sees the warnings: they are given once per key and process."""
    runtime_config._warned.clear()
    yield
    runtime_config._warned.clear()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "relay.config" and r.levelno >= logging.WARNING]


def test_the_type_alone_is_that_transport_with_its_defaults_and_no_warning(tmp_path, caplog):
    f = tmp_path / "learner.toml"
    f.write_text('[weights]\ntransport = "collective"\n')
    with caplog.at_level(logging.WARNING, logger="relay.config"):
        assert LearnerConfig().weights.transport == StoreTransport()
        assert load_config(LearnerConfig, f, environ={}).weights.transport == CollectiveTransport()
        assert load_config(
            LearnerConfig, None, set_overrides(["weights.transport=http"]), environ={}
        ).weights.transport == (HttpTransport())
        env = {"RELAY_WEIGHTS__TRANSPORT": "ipc"}
        assert load_config(GeneratorConfig, None, environ=env).weights.transport == IpcTransport()
        assert GeneratorConfig(weights={"transport": "http"}).weights.transport.type == "http"
    assert _warnings(caplog) == []


def test_the_type_alone_merges_with_fields_set_beside_it_in_either_order():
    for sets in (
        ["weights.transport=collective", "weights.transport.timeout_s=10"],
        ["weights.transport.timeout_s=10", "weights.transport=collective"],
    ):
        cfg = load_config(LearnerConfig, None, set_overrides(sets), environ={})
        assert cfg.weights.transport == CollectiveTransport(timeout_s=10), sets
    env = {"RELAY_WEIGHTS__TRANSPORT__PORT": "8200", "RELAY_WEIGHTS__TRANSPORT": "http"}
    assert load_config(LearnerConfig, None, environ=env).weights.transport == HttpTransport(port=8200)
    # a field of another transport is an error naming it
    with pytest.raises(ConfigError, match=r"weights\.transport\.ipc\.timeout_s"):
        load_config(LearnerConfig, None, set_overrides(["weights.transport=ipc", "weights.transport.timeout_s=1"]))


def test_a_layer_naming_another_type_replaces_the_section_below(tmp_path):
    """A service on its own, as ``relay up``: the fields of the file's transport (or backend) do not carry over
    to the type a later layer names; an old file's http settings under a store transport are no error."""
    f = tmp_path / "generator.toml"
    f.write_text(
        '[weights]\ntransport = "http"\n[weights.http]\ncache_dir = "/tmp/c"\n[backend]\ntype = "torch"\nthreads = 2\n'
    )
    env = {"RELAY_WEIGHTS__TRANSPORT": "store"}
    cfg = load_config(GeneratorConfig, f, set_overrides(["backend.type=simulated"]), environ=env)
    assert cfg.weights.transport == StoreTransport() and cfg.backend.type == "simulated"
    cfg = load_config(GeneratorConfig, f, set_overrides(["weights.transport.linger_s=2"]), environ={})
    assert cfg.weights.transport == HttpTransport(cache_dir="/tmp/c", linger_s=2)  # the same type merges


def test_an_old_section_moves_into_its_transport_with_one_warning(caplog):
    old = {"transport": "http", "http": {"port": 8200, "cache_dir": "/tmp/c"}, "collective": {"timeout_s": 5}}
    with caplog.at_level(logging.WARNING, logger="relay.config"):
        cfg = LearnerConfig(weights=old)
        again = GeneratorConfig(weights=old)  # the same keys again: no second warning
    assert cfg.weights.transport == HttpTransport(port=8200, cache_dir="/tmp/c") == again.weights.transport
    said = _warnings(caplog)
    assert len(said) == 2, said
    assert any('http.* was renamed transport.* (with transport.type = "http")' in m for m in said), said
    # the collective section never applied to an http transport: it is dropped, saying so
    assert any("collective.* was renamed" in m and 'ignored here: transport.type is "http"' in m for m in said)
    # the default transport (store) takes no old section either
    assert (
        LearnerConfig(weights={"http": {"host": "0.0.0.0"}, "auth": "insecure"}).weights.transport == StoreTransport()
    )


def test_an_old_section_in_one_layer_follows_the_type_of_another(tmp_path, caplog):
    """A file's ``[weights.http]`` (or a variable's) under a ``--set weights.transport=http``: the type counts once
    the layers are merged, for a service on its own and for ``relay up`` (which also takes the variable)."""
    f = tmp_path / "generator.toml"
    f.write_text('[weights.http]\nadvertise_url = "http://learner:8200"\n')
    with caplog.at_level(logging.WARNING, logger="relay.config"):
        cfg = load_config(GeneratorConfig, f, set_overrides(["weights.transport=http"]), environ={})
        env = {"RELAY_WEIGHTS__HTTP__PORT": "8201", "RELAY_WEIGHTS__TRANSPORT": "http"}
        alone = load_config(LearnerConfig, None, environ=env)
    assert cfg.weights.transport == HttpTransport(advertise_url="http://learner:8200")
    assert alone.weights.transport == HttpTransport(port=8201)
    # a file that names another type than a later layer: its old section waits for the type that counts
    f.write_text('[weights]\ntransport = "store"\n[weights.http]\nport = 8202\n')
    cfg = load_config(GeneratorConfig, f, set_overrides(["weights.transport=http"]), environ={})
    assert cfg.weights.transport == HttpTransport(port=8202)
    assert environment.resolve(environment.config_models(), env)["learner"]["weights"]["http"] == {"port": 8201}
    assert sum("http.* was renamed" in m for m in _warnings(caplog)) == 1


def test_relay_up_reads_the_old_sections(tmp_path, caplog):
    (tmp_path / "run.toml").write_text('[weights]\ntransport = "collective"\n[weights.collective]\nbucket_mb = 8\n')
    with caplog.at_level(logging.WARNING, logger="relay.config"):
        p = plan_up(
            tmp_path,
            "--run-id",
            "old",
            "--config",
            str(tmp_path / "run.toml"),
            "--set",
            "generator.weights.collective.timeout_s=5",
        )
    # the configs the services are given (runs/<id>/config/*.json) are in today's spelling
    assert p["learner"]["weights"]["transport"] == {"type": "collective", "bucket_mb": 8}
    assert p["generator"]["weights"]["transport"] == {"type": "collective", "bucket_mb": 8, "timeout_s": 5}
    assert "collective" not in p["learner"]["weights"] and p["learner_config"].weights.transport.bucket_mb == 8
    assert any("collective.* was renamed transport.*" in m for m in _warnings(caplog))
    # the http transport's fixed port goes into the section the generators read it from
    p = plan_up(tmp_path, "--run-id", "old-http", "--set", "weights.transport=http", "--set", "weights.http.linger_s=1")
    t = p["learner"]["weights"]["transport"]
    assert t["type"] == "http" and t["linger_s"] == 1 and t["port"] > 0
    assert p["generator"]["weights"]["transport"]["port"] == t["port"]


def test_an_old_key_beside_its_new_spelling_is_an_error_naming_both(tmp_path):
    both = {"transport": {"type": "http", "port": 1}, "http": {"port": 2}}
    with pytest.raises(ValueError, match=r"http\.port and transport\.port are one setting"):
        LearnerConfig(weights=both)
    f = tmp_path / "learner.toml"
    f.write_text('[weights.transport]\ntype = "http"\nport = 1\n')
    with pytest.raises(ConfigError, match=r"http\.port and transport\.port are one setting"):
        load_config(LearnerConfig, f, set_overrides(["weights.http.port=2"]), environ={})
