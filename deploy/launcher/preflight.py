"""``relay up``'s checks of the whole run before anything starts: each mistake that would make a
service fail at start-up, every time, is found here in seconds and reported as one line naming the
fix, with no process started and no run folder written.

Every check is the services' own start-up code, called here too (one piece of code per check):

- the dataset: its path, rows and field mapping, ``start`` within its rows, the chat template when
  ``chat_template = "always"``, and its first rows built into prompts with the tokenizer they will
  use (``check_dataset``, broker/prompts/datasets.py; the broker runs it at start);
- the model folder: config, weights and tokenizer (``check_model_folder``, learner/model_folder.py;
  the learner runs it before loading the model);
- the backend's engine is installed (``check_backend_installed``, generators/config.py; a generator
  runs it when it builds its backend);
- the reward plugins' secrets are set (``check_secrets``, reward_service/config.py; each plugin
  resolves its token with the same code when it starts);
- an external Redis (``--redis-url``) answers.

Only a dataset check loads a tokenizer (transformers); the rest reads files and configs.
"""

from __future__ import annotations

from broker.config import BrokerConfig
from generators.config import GeneratorConfig
from learner.config import LearnerConfig
from reward_service.config import RewardConfig


class PreflightError(Exception):
    """One start-up mistake; the message is one line that names it and its fix."""


def _tokenizer(path: str):
    """The tokenizer the broker will use for a dataset: its own folder, the model's, or the built-in one."""
    if path == "tiny":
        from learner.tiny_model import build_tokenizer

        return build_tokenizer()
    from broker.prompts.datasets import load_tokenizer

    return load_tokenizer(path)


def check_run(p: dict) -> list[str]:
    """Check the run ``p`` (``plan()``'s result) before anything starts; raise PreflightError on the first
    mistake. Returns notes worth printing (e.g. a dataset that ends before the last step)."""
    from broker.prompts.datasets import DatasetError, check_dataset, read_rows
    from generators.config import BackendMissing, check_backend_installed
    from learner.model_folder import ModelFolderError, check_model_folder
    from reward_service.config import check_secrets

    broker = BrokerConfig.model_validate(p["broker"])
    learner = LearnerConfig.model_validate(p["learner"])
    generator = GeneratorConfig.model_validate(p["generator"])
    reward = RewardConfig.model_validate(p["reward"])
    notes: list[str] = []
    try:
        check_model_folder(learner.model)
    except ModelFolderError as e:
        raise PreflightError(str(e)) from None
    try:
        check_backend_installed(generator.backend)
    except BackendMissing as e:
        raise PreflightError(str(e)) from None
    try:
        check_secrets(reward)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    if p.get("redis_port") is None:
        _check_redis(p["redis_url"])
    tokenizers: dict[str, object] = {}

    def tokenizer(path: str):
        if path not in tokenizers:
            tokenizers[path] = _tokenizer(path)
        return tokenizers[path]

    main = broker.dataset
    for ds, name in ((main, "broker.dataset"), (broker.eval.dataset, "broker.eval.dataset")):
        if ds is None:
            continue
        tok_path = ds.tokenizer or (main.tokenizer if main else "") or learner.model
        try:
            rows = read_rows(ds)  # first, without a tokenizer (transformers takes seconds to import)
            try:
                tok = tokenizer(tok_path)
            except (OSError, ValueError) as e:
                raise PreflightError(f"{name}: cannot load the tokenizer of {tok_path}: {_one_line(e)}") from None
            check_dataset(ds, tok, rows)
        except DatasetError as e:
            raise PreflightError(f"{name}: {e}") from None
        if ds is main and main.epochs is not None:
            prompts, need = len(rows) * main.epochs, learner.steps * learner.batch_groups
            if prompts < need:
                notes.append(f"the dataset gives {prompts} prompts ({len(rows)} rows x {main.epochs} epochs) and "
                             f"{learner.steps} steps x {learner.batch_groups} groups need {need}: the run will end "
                             f"when the data ends, near step {prompts // learner.batch_groups}")
    return notes


def _check_redis(url: str) -> None:
    import redis

    from broker.client.connection import redact_url

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping()
    except redis.RedisError as e:
        raise PreflightError(f"Redis at {redact_url(url)} (--redis-url) does not answer: {e}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]
