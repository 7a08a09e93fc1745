"""A remote environment over TLS, against a real HTTPS server with certificates made in the test: its bearer
token and the reference answer reach the server the operator trusts (a CA of its own, optionally a pinned
certificate), and never a server that only holds the address; plain http leaves loopback only when the
operator says so."""

import time

import pytest

from broker.protocol.messages import PromptEntry
from generators.envs.base import EnvError
from generators.envs.registry import build_env
from reward_service.tls import certificate_sha256
from tests.support.services import wait_until
from tests.support.tls import CA, https_env_server

P = PromptEntry("7*8=", reference="56", task="calc")
TOKEN = "env-s3cret"


@pytest.fixture
def pki(tmp_path):
    ours, theirs = CA(tmp_path / "ours", "ours"), CA(tmp_path / "theirs", "theirs")
    return ours, theirs


def _episode(url: str, **options):
    factory = build_env(
        "remote", {"url": url, "token": TOKEN, "retries": 2, "backoff_s": 0.01, "timeout_s": 5, **options}
    )
    try:
        env = factory()
        env.reset(P)
        result = env.step("56")
        env.close()
        return result, factory.stats()
    finally:
        factory.close()


def test_a_server_with_a_certificate_of_the_configured_ca_gets_the_episode(pki):
    ours, _ = pki
    server = https_env_server(ours.issue("env"))
    try:
        result, _ = _episode(server.url, ca_file=str(ours.pem))
        assert result.done and result.reward == 1.0
        reset = server.requests[0]
        assert reset["path"] == "/reset" and reset["authorization"] == f"Bearer {TOKEN}"
        assert reset["body"]["prompt"]["reference"] == "56"
    finally:
        server.close()


@pytest.mark.parametrize("impostor", ["another CA", "self-signed for the system CAs"])
def test_a_server_that_only_holds_the_address_gets_nothing(pki, impostor):
    ours, theirs = pki
    server = https_env_server(theirs.issue("impostor"))  # on the address, with a certificate we never trusted
    options = {"ca_file": str(ours.pem)} if impostor == "another CA" else {}
    try:
        with pytest.raises(EnvError) as e:
            _episode(server.url, **options)
        assert e.value.reason == "tls_unverified", e.value
        assert server.requests == []  # no token, no prompt, no reference: the handshake stopped it
        wait_until(lambda: server.connections >= 1, 5, "the connection")
        time.sleep(0.3)
        assert server.connections == 1  # refused once, not retried (retries: 2)
    finally:
        server.close()


def test_a_pinned_certificate_refuses_another_one_from_the_same_ca(pki):
    ours, _ = pki
    real, impostor = ours.issue("env"), ours.issue("impostor")  # both valid for the address under our CA
    server = https_env_server(real)
    try:
        result, _ = _episode(server.url, ca_file=str(ours.pem), pin_sha256=certificate_sha256(real.der))
        assert result.done
    finally:
        server.close()
    server = https_env_server(impostor)
    try:
        with pytest.raises(EnvError) as e:
            _episode(server.url, ca_file=str(ours.pem), pin_sha256=certificate_sha256(real.der))
        assert e.value.reason == "tls_unverified" and "pinned" in str(e.value)
        assert server.requests == []
    finally:
        server.close()


def test_plain_http_is_refused_off_loopback_unless_allowed(tmp_path):
    for url in ("http://10.1.2.3:9100", "http://env.example:9100", "http://0.0.0.0:9100"):
        with pytest.raises(ValueError, match="allow_plain_http"):
            build_env("remote", {"url": url, "token": TOKEN})
        build_env("remote", {"url": url, "allow_plain_http": True}).close()
    build_env("remote", {"url": "http://127.0.0.1:9100"}).close()  # loopback: as before
    build_env("remote", {"url": "http://localhost:9100"}).close()
    with pytest.raises(ValueError, match="https"):
        build_env("remote", {"url": "http://127.0.0.1:9100", "pin_sha256": "ab" * 32})
    with pytest.raises(ValueError, match="ca_file"):
        build_env("remote", {"url": "https://127.0.0.1:9100", "ca_file": str(tmp_path / "missing.pem")})
    with pytest.raises(ValueError, match="pin_sha256"):
        build_env("remote", {"url": "https://127.0.0.1:9100", "pin_sha256": "not hex"})
