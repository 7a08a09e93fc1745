"""A listener whose authentication is off refuses an address other hosts can reach, naming the setting,
unless the service's allow_unauthenticated_bind says so (docs/security.md, "Listeners")."""

import pytest
from pydantic import ValidationError

from broker.config import BrokerConfig
from broker.runtime.binds import is_loopback, zmq_bind_host
from learner.config import LearnerConfig
from reward_service.config import RewardConfig


def test_loopback_and_zeromq_hosts():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.0.3", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "*", "", "10.0.0.5", "reward", "eth0", "lo"))
    assert zmq_bind_host("tcp://0.0.0.0:5555") == "0.0.0.0" and zmq_bind_host("tcp://*:5555") == "*"
    assert zmq_bind_host("tcp://[::1]:5555") == "[::1]" and zmq_bind_host("tcp://127.0.0.1:0") == "127.0.0.1"
    assert zmq_bind_host("ipc:///tmp/ingest") is None and zmq_bind_host("inproc://x") is None


def _error(model, **cfg) -> str:
    with pytest.raises(ValidationError) as e:
        model.model_validate(cfg)
    return str(e.value)


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://eth0:5555"])
def test_an_insecure_ingest_on_a_reachable_address_is_refused(bind):
    msg = _error(BrokerConfig, ingest_auth="insecure", ingest_bind=bind)
    assert "ingest_bind" in msg and "ingest_auth = 'insecure'" in msg and "allow_unauthenticated_bind" in msg
    BrokerConfig(ingest_auth="insecure", ingest_bind=bind, allow_unauthenticated_bind=True)  # said explicitly
    BrokerConfig(ingest_auth="curve", ingest_bind=bind)  # authenticated: anywhere
    BrokerConfig(ingest_auth="insecure", ingest_bind="tcp://127.0.0.1:5555")  # loopback: as before


def test_a_reward_service_without_a_token_on_a_reachable_host_is_refused():
    msg = _error(RewardConfig, host="0.0.0.0")
    assert "host = '0.0.0.0'" in msg and "auth_token" in msg and "allow_unauthenticated_bind" in msg
    RewardConfig(host="0.0.0.0", auth_token="t")
    RewardConfig(host="0.0.0.0", allow_unauthenticated_bind=True)
    RewardConfig(host="127.0.0.1")


def test_a_weight_listener_without_the_weights_key_on_a_reachable_host_is_refused():
    for transport in ("http", "collective"):
        weights = {"transport": {"type": transport, "host": "0.0.0.0"}, "auth": "insecure"}
        msg = _error(LearnerConfig, weights=weights)
        assert "weights.transport.host" in msg and f"the {transport} transport" in msg
        assert "weights.auth = 'insecure'" in msg
        assert "allow_unauthenticated_bind" in msg
        LearnerConfig(weights={**weights, "auth": "key"})  # the weights key guards it
        LearnerConfig(weights=weights, allow_unauthenticated_bind=True)
    LearnerConfig(weights={"transport": "ipc", "auth": "insecure"})  # no listener
