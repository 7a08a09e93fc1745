"""The start-up checks relay up runs before anything starts, each the service's own code: the model
folder (learner/model_folder.py), the backend's package (generators/config.py), the reward plugins'
secrets (reward_service/config.py)."""

import importlib.util

import pytest

from generators.config import BackendMissing, TorchBackendConfig, VLLMBackendConfig, check_backend_installed
from learner.model_folder import ModelFolderError, check_model_folder
from reward_service.config import RewardConfig, check_secrets


def test_a_model_folder_needs_config_weights_and_tokenizer(tmp_path):
    m = tmp_path / "m"
    with pytest.raises(ModelFolderError, match="does not exist"):
        check_model_folder(str(m))
    m.mkdir()
    with pytest.raises(ModelFolderError, match="no config.json"):
        check_model_folder(str(m))
    (m / "config.json").write_text("{}")
    with pytest.raises(ModelFolderError, match="config.json but no weights"):
        check_model_folder(str(m))
    (m / "model-00001-of-00002.safetensors").write_bytes(b"")  # shards count
    with pytest.raises(ModelFolderError, match="no tokenizer"):
        check_model_folder(str(m))
    (m / "tokenizer.json").write_text("{}")
    assert check_model_folder(str(m)) == m.resolve()
    assert str(check_model_folder("tiny")) == "tiny"


def test_a_backend_whose_package_is_missing_is_named_with_the_fix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(BackendMissing, match=r"needs the vllm package.*pip install vllm.*--backend torch"):
        check_backend_installed(VLLMBackendConfig())
    with pytest.raises(BackendMissing):
        VLLMBackendConfig().build()  # the generator's own start-up runs the same check
    check_backend_installed(TorchBackendConfig())  # needs nothing beyond torch


def test_an_unset_token_env_is_named(monkeypatch):
    cfg = RewardConfig.model_validate(
        {
            "plugins": {
                "grader": {
                    "type": "remote",
                    "options": {"url": "http://127.0.0.1:9/score", "token_env": "PREFLIGHT_TEST_TOKEN"},
                }
            }
        }
    )
    monkeypatch.delenv("PREFLIGHT_TEST_TOKEN", raising=False)
    with pytest.raises(ValueError, match=r"reward.plugins.grader.options: token_env names 'PREFLIGHT_TEST_TOKEN'"):
        check_secrets(cfg)
    monkeypatch.setenv("PREFLIGHT_TEST_TOKEN", "s3cret")
    check_secrets(cfg)


def test_progress_shows_length_and_truncation_and_the_warning_prints_once(capsys):
    from deploy.launcher.progress import Progress, TruncationWarning

    learner = {
        "step": 7.0,
        "reward_mean": 0.5,
        "completion_len_mean": 6.6,
        "completion_len_max": 8.0,
        "completion_truncated_frac": 0.625,
    }
    Progress(True, 40, tty=False).show({"learner": learner, "learner_version": 7, "queue_depth": 3, "generators": []})
    assert "reward 0.500  len 7/8 cut 62%  queue 3" in capsys.readouterr().out
    warn = TruncationWarning(Progress(False, 40), 8)
    warn.check(learner)  # the learner has not warned: nothing
    assert capsys.readouterr().out == ""
    for _ in range(3):
        warn.check(dict(learner, truncated_warning_frac=0.7))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "70% of the completions of the last steps stopped at max_tokens" in out[0]
    assert "raise generator.sampling.max_tokens = 8" in out[0]


def test_learning_rates_far_from_the_models_are_a_note_and_absurd_ones_an_error():
    """lr=1000 was accepted (with a warning that blamed max_tokens), 1e30 too: 1 or more is an error; a rate
    far from the one the model's kind trains at is a note naming the range that suits it."""
    from learner.config import LearnerConfig, lr_problems

    assert lr_problems(LearnerConfig()) == (None, [])  # the defaults
    assert lr_problems(LearnerConfig(model="/m", lora={"rank": 8})) == (None, [])
    error, _ = lr_problems(LearnerConfig(lr=1000.0))
    assert error.startswith("learner.optim.lr = 1000 is no learning rate") and "set learner.optim.lr below 1" in error
    error, _ = lr_problems(LearnerConfig(critic={"enabled": True, "lr": 5.0}, advantage="gae"))
    assert error.startswith("learner.critic.lr = 5 is no learning rate")
    _, notes = lr_problems(LearnerConfig(lr=0.5))
    assert notes == [
        "learner.optim.lr = 0.5 is 500x above the 0.001 that the built-in tiny model trains at: training "
        "usually diverges (the policy dies); a rate from 1e-05 to 0.02 suits it (docs/learner.md)"
    ]
    _, notes = lr_problems(LearnerConfig(model="/m", lr=1e-3))
    assert len(notes) == 1 and "1000x above the 1e-06 that a pretrained model trains at" in notes[0]
    _, notes = lr_problems(LearnerConfig(model="/m", lr=1e-3, lora={"rank": 8}))  # LoRA trains at 10x
    assert "100x above the 1e-05 that a pretrained model with LoRA trains at" in notes[0]
    _, notes = lr_problems(LearnerConfig(lr=1e-9))
    assert "1000000x below" in notes[0] and "hardly anything will be learnt" in notes[0]


def test_the_truncation_warning_blames_a_broken_policy_not_max_tokens(capsys):
    """With lr=1000 the tiny model's output went uniform (gradient 0 from step 2): 59% of its completions ran to
    max_tokens, and the warning said to raise max_tokens. When the policy is broken, it says that instead."""
    from deploy.launcher.alerts import PolicyWatch
    from deploy.launcher.progress import Progress, TruncationWarning

    watch = PolicyWatch()
    watch.update(
        [{"step": 1, "grad_norm": 0.28, "loss": 0.068, "entropy": 2.652}]
        + [{"step": s, "grad_norm": 0.0, "loss": 0.02, "entropy": 2.708} for s in range(2, 8)]
    )
    TruncationWarning(Progress(False, 40), 8).check(
        {"step": 7.0, "completion_len_mean": 6.6, "truncated_warning_frac": 0.59}, watch.suspect()
    )
    out = capsys.readouterr().out
    assert "59% of the completions of the last steps stopped at max_tokens" in out
    assert (
        "but the budget is not what is wrong: the policy is broken (its gradient has been 0 for the last 6 "
        "steps while its loss is not (entropy 2.708)"
        in out
        and "raise generator" not in out
    )
