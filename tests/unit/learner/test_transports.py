"""The weight transport is chosen in one place per side (learner/transports.py, generators/transports.py), from
the ends its config class names (broker/protocol/weights_config.py): every type of ``weights.transport`` has
both ends, each end is the class its file names, and the sender of the http transport serves the store and
names its URLs in the announcements."""

import importlib
import logging
import typing

import pytest

from broker.protocol.keys import Keys
from broker.protocol.weights_config import IN_PROCESS_TRANSPORTS, TRANSPORTS, WeightsConfig
from generators.config import GeneratorConfig
from generators.transports import ReceiverContext, Receiving, build_receiving
from learner.config import LearnerConfig
from learner.transports import Sender, SenderContext, build_sender


def _load(spec: str):
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


def test_every_transport_has_a_sender_and_a_receiver():
    union = typing.get_args(WeightsConfig.model_fields["transport"].annotation)
    assert [c.model_fields["type"].default for c in union] == list(TRANSPORTS) == ["store", "http", "collective", "ipc"]
    for name, config in TRANSPORTS.items():
        cls = _load(config.sender)
        assert issubclass(cls, Sender) and cls.name == name
        assert config.receiver is None if name == "store" else callable(_load(config.receiver))
    assert IN_PROCESS_TRANSPORTS == ("collective", "ipc")  # versions handed to the engines in process


def test_the_store_transport_adds_nothing_on_either_side(tmp_path):
    lc = LearnerConfig(weight_store=str(tmp_path))
    sender = build_sender(SenderContext(lc, None, Keys("t"), None, None))
    assert type(sender) is Sender and sender.handoff is None
    gc = GeneratorConfig(reward_url="http://127.0.0.1:9")
    assert build_receiving(ReceiverContext(gc, None, Keys("t"), object(), None, None)) == Receiving()


def test_the_http_sender_serves_the_store_and_names_its_urls(tmp_path):
    import urllib.request

    (tmp_path / "v000001").mkdir()
    lc = LearnerConfig(weight_store=str(tmp_path), weights={"transport": "http", "auth": "insecure"})
    sender = build_sender(SenderContext(lc, None, Keys("t"), None, None))

    class Pub:
        url_for = None

    pub = Pub()
    sender.attach(pub)
    try:
        url = pub.url_for(1)
        assert url.startswith("http://127.0.0.1:") and url.rstrip("/").endswith("v000001")
        with pytest.raises(urllib.error.HTTPError) as e:  # served: a file the version does not hold is a 404
            urllib.request.urlopen(url.rstrip("/") + "/missing.json", timeout=5)
        assert e.value.code == 404
    finally:
        sender.server.close()


@pytest.mark.parametrize("transport", IN_PROCESS_TRANSPORTS)
def test_a_backend_that_cannot_take_tensors_follows_the_store(transport, caplog):
    class Engine:
        name = "plain"

    gc = GeneratorConfig(reward_url="http://127.0.0.1:9", weights={"transport": transport, "auth": "insecure"})
    with caplog.at_level(logging.WARNING, logger="relay.generator"):
        got = build_receiving(ReceiverContext(gc, None, Keys("t"), Engine(), None, None))
    assert got == Receiving() and "loads each version from the store copy" in caplog.text


def test_the_http_receiver_fetches_only_from_the_configured_server():
    from broker.runtime.config import ConfigError
    from generators.weight_fetch import WeightFetcher

    gc = GeneratorConfig(reward_url="http://127.0.0.1:9", weights={"transport": "http", "auth": "insecure"})
    with pytest.raises(ConfigError, match="advertise_url"):
        build_receiving(ReceiverContext(gc, None, Keys("t"), object(), None, None))
    gc = GeneratorConfig(
        reward_url="http://127.0.0.1:9",
        weights={"transport": {"type": "http", "advertise_url": "http://127.0.0.1:5999"}, "auth": "insecure"},
    )
    got = build_receiving(ReceiverContext(gc, None, Keys("t"), object(), None, None))
    assert isinstance(got.fetcher, WeightFetcher) and got.tensors is None
