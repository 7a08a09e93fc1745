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
        "url": "http://127.0.0.1:9/score", "token_env": "RELAY_TEST_TOKEN"}}}})
    monkeypatch.delenv("RELAY_TEST_TOKEN", raising=False)
    with pytest.raises(ValueError, match=r"reward.plugins.grader.options: token_env names 'RELAY_TEST_TOKEN'"):
        check_secrets(cfg)
    monkeypatch.setenv("RELAY_TEST_TOKEN", "s3cret")
    check_secrets(cfg)
