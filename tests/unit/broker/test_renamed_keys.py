"""Keys that moved into sections (issue 41; broker/runtime/config.py ``move_renamed``): the old spelling still
works, with one warning naming the new one, in a file, a variable and ``--set`` (of a service and of ``relay up``);
both spellings of one key in one place are an error."""

import logging

import pytest

from broker.runtime import config as runtime_config
from broker.runtime.config import ConfigError, load_config, set_overrides
from generators.config import GeneratorConfig
from learner.config import LearnerConfig


@pytest.fixture(autouse=True)
def _warn_again():
    """Each test sees the warnings: they are given once per key and process."""
    runtime_config._warned.clear()
    yield
    runtime_config._warned.clear()


def _renamed_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "relay.config" and "renamed" in r.getMessage()]


def test_a_flat_key_moves_into_its_section_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="relay.config"):
        cfg = LearnerConfig.model_validate({"lr": 1e-3, "batch_groups": 8, "versions_kept": 7})
        again = LearnerConfig(lr=2e-3)  # the same key again: no second warning
    assert (cfg.optim.lr, cfg.batch.groups, cfg.publish.keep_announcements) == (1e-3, 8, 7)
    assert again.optim.lr == 2e-3
    said = _renamed_warnings(caplog)
    assert len(said) == 3 and any("lr was renamed optim.lr" in m for m in said), said
    assert any("versions_kept was renamed publish.keep_announcements" in m for m in said), said
    gen = GeneratorConfig.model_validate({"reward_url": "http://r:1", "max_episode_tokens": 9, "metrics_port": 91})
    assert (gen.reward.url, gen.episodes.max_tokens, gen.metrics.port) == ("http://r:1", 9, 91)


def test_both_spellings_of_one_key_are_an_error_naming_them():
    with pytest.raises(ValueError, match=r"lr and optim\.lr are one setting"):
        LearnerConfig.model_validate({"lr": 1e-3, "optim": {"lr": 2e-3}})
    with pytest.raises(ConfigError, match=r"reward_url and reward\.url are one setting"):
        load_config(
            GeneratorConfig, None, set_overrides(["reward_url=http://a:1", "reward.url=http://b:1"]), environ={}
        )


def test_a_service_takes_the_old_spelling_from_set_a_file_and_the_environment(tmp_path, caplog):
    f = tmp_path / "learner.toml"
    f.write_text("[optim]\nlr = 1e-3\n[batch]\ngroups = 4\n")
    with caplog.at_level(logging.WARNING, logger="relay.config"):
        cfg = load_config(LearnerConfig, f, set_overrides(["lr=5e-4"]), environ={"RELAY_BATCH_GROUPS": "16"})
    # each layer migrated on its own: the later layer's old spelling overrides the file's new one
    assert cfg.optim.lr == 5e-4 and cfg.batch.groups == 16
    assert any("batch_groups was renamed batch.groups" in m for m in _renamed_warnings(caplog))


def test_relay_up_takes_the_old_spelling_from_set_over_a_file_of_new_ones(tmp_path, caplog):
    from tests.support.up_plan import plan_up as _plan

    (tmp_path / "run.toml").write_text("[learner.optim]\nlr = 1e-3\n")
    with caplog.at_level(logging.WARNING, logger="relay.config"):
        p = _plan(
            tmp_path,
            "--run-id",
            "old",
            "--config",
            str(tmp_path / "run.toml"),
            "--set",
            "learner.lr=5e-4",
            "--set",
            "generator.max_turns=3",
            "--set",
            "learner.keep_versions=6",
        )
    assert p["learner"]["optim"] == {"lr": 5e-4} and p["generator"]["episodes"] == {"max_turns": 3}
    assert p["learner_config"].optim.lr == 5e-4 and p["learner_config"].publish.keep_versions == 6
    assert any("lr was renamed optim.lr" in m for m in _renamed_warnings(caplog))
    p = _plan(tmp_path, "--run-id", "new", "--set", "learner.optim.lr=5e-4", "--set", "learner.batch.groups=4")
    assert p["learner_config"].optim.lr == 5e-4 and p["learner_config"].batch.groups == 4
    with pytest.raises(ConfigError, match=r"\[learner\] .*lr and optim\.lr are one setting"):
        _plan(tmp_path, "--run-id", "both", "--set", "learner.lr=1e-3", "--set", "learner.optim.lr=2e-3")
