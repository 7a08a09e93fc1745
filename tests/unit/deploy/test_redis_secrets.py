"""The Redis URL is a secret: printed redacted, kept out of the run's config files, given through the
environment; an external Redis's URL is used as given."""

import json

from broker.client.connection import redact_url
from deploy.launcher.environment import split_secrets
from deploy.launcher.start import _write_config


def test_redact_url_hides_the_password_only():
    assert redact_url("redis://learner:s3cr%40t@127.0.0.1:6390/0") == "redis://learner:***@127.0.0.1:6390/0"
    assert (
        redact_url("rediss://:pw@redis.example:6380/1?ssl_cert_reqs=required")
        == "rediss://:***@redis.example:6380/1?ssl_cert_reqs=required"
    )
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("unix:///run/redis.sock") == "unix:///run/redis.sock"
    assert "pw" not in redact_url("redis://u:pw@[::1:6379/0")  # unparseable: nothing of it shown


def test_the_config_file_holds_the_url_redacted_and_the_service_gets_it_in_its_environment(tmp_path):
    url = "redis://generator:Zx9-very-secret@127.0.0.1:6390/0"
    public, env = split_secrets({"run_id": "r", "redis_url": url, "reward_token": "t0k"})
    assert public == {"run_id": "r", "redis_url": "redis://generator:***@127.0.0.1:6390/0"}
    assert json.loads(env["RELAY_REDIS_URL"]) == url and json.loads(env["RELAY_REWARD_TOKEN"]) == "t0k"
    env = _write_config(tmp_path / "generator.json", {"run_id": "r", "redis_url": url}, {"PATH": "/bin"})
    assert "very-secret" not in (tmp_path / "generator.json").read_text() and "very-secret" in env["RELAY_REDIS_URL"]


def _plan(tmp_path, *argv):
    import argparse

    from deploy.launcher.plan import plan
    from deploy.launcher.up import add_up_arguments

    p = argparse.ArgumentParser()
    add_up_arguments(p)
    return plan(p.parse_args(["--runs-dir", str(tmp_path), "--dashboard-port", "0", *argv]), environ={})


def test_each_service_gets_its_own_redis_user_and_its_half_of_the_announcement_key(tmp_path):
    p = _plan(tmp_path, "--run-id", "u")
    users = p["redis_users"]
    port = p["redis_port"]
    for name in ("broker", "learner", "generator"):
        assert p[name]["redis_url"] == f"redis://{name}:{users.passwords[name]}@127.0.0.1:{port}/0"
    # the learner alone signs: the private key is in its config only; the others check with the public key
    assert p["learner"]["announce_key_file"] == str(tmp_path / "u" / "secrets" / "announce.key")
    for name in ("broker", "generator"):
        assert "announce_key_file" not in p[name]
        assert p[name]["announce_public_key_file"] == str(tmp_path / "u" / "secrets" / "announce.pub")
    assert p["redis_url"] == users.url("launcher", port) and "redis_url" not in p["reward"]
    assert len(set(users.passwords.values())) == 4
    assert p["generator"]["weight_store"] == p["learner"]["weight_store"]  # versions outside it are refused


def test_an_external_redis_url_is_used_as_given(tmp_path):
    url = "rediss://relay:pw@redis.example:6380/0"
    p = _plan(tmp_path, "--run-id", "x", "--redis-url", url)
    assert p["redis_users"] is None and p["redis_url"] == url
    assert {p[n]["redis_url"] for n in ("broker", "learner", "generator")} == {url}


def test_relay_secrets_writes_the_acl_file_again_from_the_current_rights_keeping_the_passwords(tmp_path):
    """A deployment made before the per-service rights (every user +@all on the run's keys) gets them by running
    `relay secrets` again, without new passwords (the services' env files stay valid)."""
    from deploy.launcher.run_secrets import acl_rules
    from deploy.provision import make

    folder = tmp_path / "secrets"
    files = make(folder, "compose")
    password = (folder / "redis" / "generator.password").read_text().strip()
    acl = files["redis_acl"]
    wide = acl.read_text().replace(
        acl_rules("compose", "generator", password),
        "user generator on #x resetkeys ~relay:compose:* -@all +@all -@dangerous",
    )
    acl.write_text(wide)
    make(folder, "compose")
    assert acl.read_text() != wide and acl_rules("compose", "generator", password) in acl.read_text()
    assert (folder / "redis" / "generator.password").read_text().strip() == password
