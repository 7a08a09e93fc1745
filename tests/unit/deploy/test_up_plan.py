"""``relay up``'s plan: what each service is told, before anything starts (no process, no network)."""

import argparse

from deploy.launcher.up import add_up_arguments, plan


def _plan(tmp_path, *argv):
    p = argparse.ArgumentParser()
    add_up_arguments(p)
    # an external Redis URL: plan() then needs no redis-server binary (nothing is started)
    return plan(p.parse_args(["--runs-dir", str(tmp_path), "--dashboard-port", "0",
                              "--redis-url", "redis://127.0.0.1:1/0", *argv]))


def test_generators_reach_the_broker_and_reward_service_where_the_overrides_put_them(tmp_path):
    default = _plan(tmp_path, "--run-id", "a")
    assert default["generator"]["broker_address"] == default["broker"]["ingest_bind"]
    assert default["generator"]["reward_url"] == f"http://127.0.0.1:{default['reward']['port']}"

    moved = _plan(tmp_path, "--run-id", "b", "--set", "broker.ingest_bind=tcp://127.0.0.1:6123",
                  "--set", "reward.port=6200")
    assert moved["broker"]["ingest_bind"] == "tcp://127.0.0.1:6123"
    assert moved["generator"]["broker_address"] == "tcp://127.0.0.1:6123"
    assert moved["generator"]["reward_url"] == "http://127.0.0.1:6200"

    # bound on every interface: the generators on this machine connect through the loopback
    wildcard = _plan(tmp_path, "--run-id", "c", "--set", "broker.ingest_bind=tcp://0.0.0.0:6124",
                     "--set", "reward.host=0.0.0.0")
    assert wildcard["generator"]["broker_address"] == "tcp://127.0.0.1:6124"
    assert wildcard["generator"]["reward_url"] == f"http://127.0.0.1:{wildcard['reward']['port']}"

    # an explicit generator address still wins
    explicit = _plan(tmp_path, "--run-id", "d", "--set", "broker.ingest_bind=tcp://0.0.0.0:6125",
                     "--set", "generator.broker_address=tcp://gateway:7000")
    assert explicit["generator"]["broker_address"] == "tcp://gateway:7000"
