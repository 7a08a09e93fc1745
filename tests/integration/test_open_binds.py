"""Services started on their own refuse to listen on an address other hosts reach with their authentication
off, before they bind anything, with one line naming the setting (docs/security.md, "Listeners")."""

import json

from deploy.launcher.procs import free_port
from tests.support.services import relay


def _start(tmp_path, service: str, cfg: dict):
    path = tmp_path / f"{service}.json"
    path.write_text(json.dumps(cfg))
    return relay(service, "--config", str(path), timeout=120)


def test_a_reward_service_without_a_token_refuses_a_reachable_host(tmp_path):
    res = _start(tmp_path, "reward", {"host": "0.0.0.0", "port": free_port()})
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "host = '0.0.0.0'" in out and "auth_token" in out and "allow_unauthenticated_bind" in out
    assert "Traceback" not in out


def test_a_broker_with_an_insecure_ingest_refuses_a_reachable_address(tmp_path):
    res = _start(
        tmp_path,
        "broker",
        {
            "run_id": "r",
            "redis_url": "redis://127.0.0.1:1/0",
            "ingest_auth": "insecure",
            "ingest_bind": f"tcp://0.0.0.0:{free_port()}",
            "http_port": free_port(),
        },
    )
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "ingest_bind" in out and "ingest_auth = 'insecure'" in out and "allow_unauthenticated_bind" in out
    assert "Traceback" not in out
