"""Every example config under examples/ is a valid Relay config: each section validates against the
service's model, as `relay up` would check it (without starting anything)."""

from pathlib import Path

import pytest

from broker.runtime.config import read_file
from broker.config import BrokerConfig
from generators.config import GeneratorConfig
from learner.config import LearnerConfig
from reward_service.app import RewardConfig
from tests.support.services import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*/relay.toml"))


def test_there_is_an_example():
    assert any("gsm8k" in str(p) for p in EXAMPLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_example_config_validates(path: Path):
    cfg = read_file(path)
    assert set(cfg) <= {"broker", "reward", "generator", "learner"}
    broker = BrokerConfig.model_validate(cfg.get("broker", {}))
    RewardConfig.model_validate(cfg.get("reward", {}))
    gen = GeneratorConfig.model_validate(cfg.get("generator", {}))
    learner = LearnerConfig.model_validate(cfg.get("learner", {}))
    assert broker.dataset is not None and broker.dataset.chat_template == "always"
    assert broker.eval.every_versions > 0 and broker.eval.dataset is not None
    if path.parent.name.startswith("gsm8k"):  # the GPU example: stated, not measured here
        assert gen.backend.type == "vllm" and learner.deepspeed.zero_stage == 2
        assert learner.batch.groups % 2 == 0  # --learner-ranks 2
        # runnable on the stated GPUs: a pretrained model's learning rate, bounded memory (docs/learner.md)
        assert "lr" in cfg["learner"]["optim"] and learner.optim.lr <= 1e-5
        assert learner.deepspeed.bf16 and learner.compute.gradient_checkpointing
        assert 1024 <= learner.compute.micro_batch_tokens <= 65536 and "micro_batch_tokens" in cfg["learner"]["compute"]
        text = (path.parent / "README.md").read_text()
        assert "not measured" in text and "expected" in text.lower()
    else:  # a CPU example: `make` runs it, its README gives what was measured
        assert gen.backend.type == "torch" and "lr" in cfg["learner"]["optim"]
        assert "micro_batch_tokens" in cfg["learner"]["compute"]
        assert "measured" in (path.parent / "README.md").read_text().lower()
