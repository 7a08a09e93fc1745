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
    cfg = RewardConfig.model_validate({"plugins": {"grader": {"type": "remote", "options": {
        "url": "http://127.0.0.1:9/score", "token_env": "PREFLIGHT_TEST_TOKEN"}}}})
    monkeypatch.delenv("PREFLIGHT_TEST_TOKEN", raising=False)
    with pytest.raises(ValueError, match=r"reward.plugins.grader.options: token_env names 'PREFLIGHT_TEST_TOKEN'"):
        check_secrets(cfg)
    monkeypatch.setenv("PREFLIGHT_TEST_TOKEN", "s3cret")
    check_secrets(cfg)


def test_progress_shows_length_and_truncation_and_the_warning_prints_once(capsys):
    from deploy.launcher.progress import Progress, TruncationWarning

    learner = {"step": 7.0, "reward_mean": 0.5, "completion_len_mean": 6.6, "completion_len_max": 8.0,
               "completion_truncated_frac": 0.625}
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
