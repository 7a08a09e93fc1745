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


def test_infinities_and_nan_are_refused_with_the_field_named(tmp_path):
    from broker.config import BrokerConfig
    from reward_service.config import RewardConfig

    f = tmp_path / "learner.toml"
    f.write_text("[optim]\nlr = inf\n")  # TOML spells infinity; so does the environment's JSON ("Infinity")
    with pytest.raises(ConfigError, match=r"optim\.lr: Input should be a finite number"):
        load_config(LearnerConfig, f, environ={})
    with pytest.raises(ConfigError, match=r"correction\.tis_cap: Input should be a finite number"):
        load_config(LearnerConfig, environ={"RELAY_CORRECTION__TIS_CAP": "NaN"})
    with pytest.raises(ConfigError, match=r"dead_after_s: Input should be a finite number"):
        load_config(BrokerConfig, overrides={"dead_after_s": float("inf")}, environ={})
    with pytest.raises(ConfigError, match=r"reward\.timeout_s"):
        load_config(GeneratorConfig, environ={"RELAY_REWARD__TIMEOUT_S": "Infinity"})
    assert load_config(RewardConfig, environ={}).max_request_bytes > 0  # defaults are finite everywhere
    assert (
        load_config(LearnerConfig, overrides={"correction": {"tis_cap": None}}, environ={}).correction.tis_cap is None
    )
