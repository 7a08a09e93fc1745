"""docker-compose.yml stays consistent with the services' configs (full validation with the
compose spec and a real engine is the deployment issue's `make compose-smoke`)."""

from pathlib import Path

import yaml

from broker.service import BrokerConfig
from generators.config import GeneratorConfig
from learner.config import LearnerConfig
from reward_service.app import RewardConfig

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"broker": BrokerConfig, "reward": RewardConfig, "learner": LearnerConfig, "generator": GeneratorConfig}


def test_compose_services_and_env_match_the_configs():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", *MODELS}
    assert "container_name" not in services["generator"], "a fixed name would prevent --scale generator=N"
    for name, model in MODELS.items():
        env = services[name].get("environment", {})
        assert services[name]["command"] == ["relay", name]
        for key in env:
            assert key.startswith("RELAY_")
            field = key[len("RELAY_"):].lower().split("__")[0]
            assert field in model.model_fields, f"{name}: {key} names no config field"
