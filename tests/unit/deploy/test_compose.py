"""docker-compose.yml stays consistent with the services' configs (the compose spec, the Compose
CLI and Kubernetes checks are in test_deploy.py; a real engine runs it in `make compose-smoke`)."""

import yaml

from broker.config import BrokerConfig
from generators.config import GeneratorConfig
from learner.config import LearnerConfig
from reward_service.app import RewardConfig
from tests.support.services import ROOT

MODELS = {"broker": BrokerConfig, "reward": RewardConfig, "learner": LearnerConfig, "generator": GeneratorConfig}
# the GPU profiles' generators (vllm: the engine in the generator process; sglang: driving a server)
GPU_GENERATORS = {"generator-vllm": "vllm", "generator-sglang": "sglang"}


def test_compose_services_and_env_match_the_configs():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", *MODELS, *GPU_GENERATORS, "sglang"}
    services_of = {**MODELS, **{name: GeneratorConfig for name in GPU_GENERATORS}}
    for name in ("generator", *GPU_GENERATORS):
        assert "container_name" not in services[name], "a fixed name would prevent --scale generator=N"
    for name, backend in GPU_GENERATORS.items():
        assert services[name]["environment"]["RELAY_BACKEND__TYPE"] == backend
    for name, model in services_of.items():
        env = services[name].get("environment", {})
        assert services[name]["command"][:2] == ["relay", name.split("-")[0]]
        for key in env:
            assert key.startswith("RELAY_")
            field = key[len("RELAY_") :].lower().split("__")[0]
            assert field in model.model_fields, f"{name}: {key} names no config field"
