import pytest

from broker.runtime.config import ConfigError, load_config
from generators.config import GeneratorConfig
from learner.config import LearnerConfig


def test_file_env_and_overrides_in_order(tmp_path):
    f = tmp_path / "g.toml"
    f.write_text('id = "from-file"\nprompts_per_batch = 3\n[sampling]\ntemperature = 0.5\n')
    env = {"RELAY_PROMPTS_PER_BATCH": "5", "RELAY_SAMPLING__TOP_K": "7", "RELAY_UNRELATED": "x"}
    cfg = load_config(GeneratorConfig, f, overrides={"sampling": {"n": 2}}, environ=env)
    assert cfg.id == "from-file" and cfg.prompts_per_batch == 5
    assert (cfg.sampling.temperature, cfg.sampling.top_k, cfg.sampling.n) == (0.5, 7, 2)


def test_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"sampling\.temperature"):
        load_config(GeneratorConfig, overrides={"sampling": {"temperature": 0}}, environ={})
    with pytest.raises(ConfigError, match=r"lrr: unknown field"):
        load_config(LearnerConfig, overrides={"lrr": 1}, environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(LearnerConfig, tmp_path / "missing.toml", environ={})
