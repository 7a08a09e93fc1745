"""`relay up` gives the OpenAI endpoint a per-run key (deploy/launcher/openai_key.py): made when the endpoint is
enabled without one, kept for the operator in secrets/openai.key (0600), never in a config file, read back by a
resume; the operator's own key (RELAY_OPENAI__API_KEY) and an opened endpoint are left as they are."""

import argparse
import os
import stat

import pytest

from deploy.launcher.environment import split_secrets
from deploy.launcher.openai_key import endpoint_key, endpoint_note, openai_key_path
from deploy.launcher.plan import ConfigError, plan
from deploy.launcher.up import add_up_arguments


def _plan(tmp_path, *argv, environ=None):
    p = argparse.ArgumentParser()
    add_up_arguments(p)
    return plan(
        p.parse_args(
            [
                "--runs-dir",
                str(tmp_path),
                "--dashboard-port",
                "0",
                "--run-id",
                "a",
                "--redis-url",
                "redis://127.0.0.1:1/0",
                *argv,
            ]
        ),
        environ=environ or {},
    )


def test_an_enabled_endpoint_gets_a_key_of_its_own_that_stays_out_of_config_files(tmp_path):
    p = _plan(tmp_path, "--set", "generator.openai.enabled=true")
    key = p["generator"]["openai"]["api_key"]
    assert p["openai_key"] and len(key) >= 32
    public, env = split_secrets(p["generator"])
    assert "api_key" not in public["openai"] and env["RELAY_OPENAI__API_KEY"] == f'"{key}"'
    run_dir = tmp_path / "a"
    note = endpoint_note(run_dir, p["generator"], p["openai_key"])
    assert str(openai_key_path(run_dir)) in note and key not in note
    assert openai_key_path(run_dir).read_text().strip() == key
    assert stat.S_IMODE(os.stat(openai_key_path(run_dir)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(run_dir / "secrets").st_mode) == 0o700
    # a resume reads the same key back (its recorded config has none)
    again = {"openai": {"enabled": True}}
    assert endpoint_key(again, run_dir) and again["openai"]["api_key"] == key


def test_the_operators_key_an_open_endpoint_and_a_disabled_one_are_left_alone(tmp_path):
    p = _plan(tmp_path, "--set", "generator.openai.enabled=true", environ={"RELAY_OPENAI__API_KEY": "mine"})
    assert p["generator"]["openai"]["api_key"] == "mine" and not p["openai_key"]
    assert "you configured" in endpoint_note(tmp_path / "a", p["generator"], False)
    assert not openai_key_path(tmp_path / "a").exists()
    p = _plan(tmp_path, "--set", "generator.openai.enabled=true", "--set", "generator.openai.open=true")
    assert "api_key" not in p["generator"]["openai"] and not p["openai_key"]
    assert endpoint_note(tmp_path / "a", p["generator"], False).startswith("warning: the OpenAI endpoint is open")
    p = _plan(tmp_path)
    assert not p["openai_key"] and endpoint_note(tmp_path / "a", p["generator"], False) is None


def test_an_open_endpoint_off_loopback_is_refused_before_start(tmp_path):
    with pytest.raises(ConfigError, match="loopback"):
        _plan(
            tmp_path,
            "--set",
            "generator.openai.enabled=true",
            "--set",
            "generator.openai.open=true",
            "--set",
            "generator.openai.host=0.0.0.0",
        )
