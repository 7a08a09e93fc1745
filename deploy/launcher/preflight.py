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
- an external Redis (``--redis-url``) answers;
- the ingest keys the configs name are one broker key pair and an allow-list that admits the generators'
  key for their ids (``check_ingest_keys``, deploy/launcher/ingest_keys.py; with keys of the user's own,
  docs/protocol.md section 12);
- the learning rates (``lr_problems``, learner/config.py): 1 or more is an error, one far from the
  rate the model's kind trains at a note;
- prompt and completion fit the model's context (``context_length``, learner/model_folder.py):
  ``max_prompt_tokens`` (or, left at its default, the longest prompt of the rows checked; a built-in
  task's longest prompt) plus ``generator.sampling.max_tokens`` (an episode's ``max_episode_tokens``);
- an environment on the built-in tiny model has its tool vocabulary (``learner.tiny.tools``; the
  generator's ``check_tool_vocabulary`` refuses to start without it, at every restart).

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
    from broker.prompts.datasets import DatasetError, check_dataset, prompt_tokens, read_rows
    from learner.config import lr_problems
    from generators.config import BackendMissing, check_backend_installed
    from learner.model_folder import ModelFolderError, check_model_folder
    from broker.runtime.config import ConfigError
    from deploy.launcher.ingest_keys import check_ingest_keys
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
    try:  # the ingest keys the configs name fit together (deploy/launcher/ingest_keys.py)
        check_ingest_keys(
            p["run_dir"], p["broker"], p["generator"], p.get("generator_ids", []), p.get("producer_ids", [])
        )
    except ConfigError as e:
        raise PreflightError(str(e)) from None
    if p.get("redis_port") is None:
        _check_redis(p["redis_url"])
    error, lr_notes = lr_problems(learner)
    if error:
        raise PreflightError(error)
    notes += lr_notes
    if generator.episodes.env and learner.model == "tiny" and not learner.tiny.tools:
        raise PreflightError(
            f"generator.episodes.env = {generator.episodes.env!r} on the built-in tiny model needs its tool symbols: "
            "set learner.tiny.tools = true (relay up --task calc does), or use a model whose "
            "tokenizer has a chat template"
        )
    context = Context(learner.model, generator)
    if broker.dataset is None:
        context.check_task(broker.task)
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
        notes += context.check_dataset(ds, name, prompt_tokens(ds, tok, rows))
        if ds is main and main.epochs is not None:
            prompts, need = len(rows) * main.epochs, learner.steps * learner.batch.groups
            if prompts < need:
                notes.append(
                    f"the dataset gives {prompts} prompts ({len(rows)} rows x {main.epochs} epochs) and "
                    f"{learner.steps} steps x {learner.batch.groups} groups need {need}: the run will end "
                    f"when the data ends, near step {prompts // learner.batch.groups}"
                )
    return notes


class Context:
    """Whether prompt and completion fit the model's context (``context_length``; a vLLM backend's
    ``max_model_len`` when it is smaller). The completion's budget: ``sampling.max_tokens``, or with an
    environment the episode's ``max_episode_tokens`` (every turn and reply after the prompt). Its first check
    (the budget alone past the context) is also made by ``relay up``'s plan, before the learner's config
    refuses a budget past its micro-batch: the more fundamental mistake is the one reported."""

    def __init__(self, model: str, generator: GeneratorConfig):
        from learner.model_folder import context_length

        self.positions = context_length(model)
        limit = getattr(generator.backend, "max_model_len", 0)
        if limit and (self.positions is None or limit < self.positions):
            self.positions = limit
        self.budget, self.setting = generator.generation_budget
        self.model = "the built-in tiny model" if model == "tiny" else f"the model ({model})"
        if self.positions is not None and self.budget >= self.positions:
            raise PreflightError(
                f"{self.setting} = {self.budget} does not fit {self.model}'s context of "
                f"{self.positions} positions (prompt and completion together): set it below "
                f"{self.positions}, leaving room for the prompt (docs/datasets.md)"
            )

    def _fit(self, prompt: int, what: str) -> None:
        if self.positions is not None and prompt + self.budget > self.positions:
            raise PreflightError(
                f"{what} ({prompt} tokens) + {self.setting} ({self.budget}) is more than "
                f"{self.model}'s context of {self.positions} positions: lower {self.setting} to "
                f"{self.positions - prompt} or less, or shorten the prompts (docs/datasets.md)"
            )

    def check_task(self, task) -> None:
        """A built-in task's longest prompt (its characters and the special tokens: at most a token each)."""
        from broker.prompts.tasks import longest_prompt_tokens

        self._fit(longest_prompt_tokens(task), f"the {task.name} task's longest prompt")

    def check_dataset(self, ds, name: str, lengths: list[int]) -> list[str]:
        """A dataset: ``max_prompt_tokens`` set by the user must fit with the budget; left at its default, the
        longest prompt of the rows checked (``lengths``) must, and a note says what to set."""
        if self.positions is None:
            return []
        room = self.positions - self.budget
        if "max_prompt_tokens" in ds.model_fields_set:
            if ds.max_prompt_tokens > room:
                raise PreflightError(
                    f"{name}.max_prompt_tokens ({ds.max_prompt_tokens}) + {self.setting} "
                    f"({self.budget}) is more than {self.model}'s context of {self.positions} "
                    f"positions: set {name}.max_prompt_tokens to {room} or less (longer prompts are "
                    f"skipped and counted), or lower {self.setting} (docs/datasets.md)"
                )
            return []
        if lengths:
            self._fit(max(lengths), f"{name}'s longest prompt of the rows checked")
        if ds.max_prompt_tokens > room:
            return [
                f"{name}.max_prompt_tokens is {ds.max_prompt_tokens} (the default), but only prompts of up to "
                f"{room} tokens fit {self.model}'s {self.positions} positions with {self.setting} = "
                f"{self.budget}: set {name}.max_prompt_tokens = {room} so that a longer prompt is skipped (and "
                f"counted) rather than overflow"
            ]
        return []


def _check_redis(url: str) -> None:
    import redis

    from broker.client.connection import redact_url

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping()
    except redis.RedisError as e:
        raise PreflightError(f"Redis at {redact_url(url)} (--redis-url) does not answer: {e}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]
