"""Prompt datasets: a user's own prompts, read from JSONL, Parquet, CSV or a Hugging Face dataset saved
to disk, turned into prompt records for the feeder (docs/datasets.md).

A row becomes one prompt record: the prompt (a text field, or a list of chat messages), an optional
system prompt, the reference answer, the task name (which picks the reward plugin) and metadata
fields passed through to the reward plugins. For an instruct model the tokenizer's chat template is
applied (``apply_chat_template(messages, add_generation_prompt=True)``) and the record carries the
exact token ids (``prompt_ids``) the generators feed the model; without a template the text is
encoded as is (``tokenizer(text)["input_ids"]``). A prompt longer than ``max_prompt_tokens`` is
skipped and counted, never truncated.

The order is a seeded permutation per epoch, so a position ``(epoch, index)`` names the next prompt
exactly; the feeder stores it in Redis together with the prompts it adds (broker/feeder.py), and a
restarted broker resumes where it was.

No torch here: tokenizers load through ``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import csv
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from broker.protocol.messages import PromptEntry
from broker.runtime.config import StrictModel

log = logging.getLogger("relay.broker.datasets")

FORMATS = ("jsonl", "parquet", "csv", "hf_disk")


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file, the row or the field."""


class DatasetConfig(StrictModel):
    """A prompt dataset and how its rows become prompts."""

    path: str = Field(
        description="a .jsonl/.json, .parquet or .csv file, a folder of such files (read in name "
        "order), or a Hugging Face dataset saved with save_to_disk"
    )
    format: Literal["auto", "jsonl", "parquet", "csv", "hf_disk"] = Field(
        "auto", description="file format; auto: from the suffix, or hf_disk for a save_to_disk folder"
    )
    split: str = Field("train", description="the split of a saved DatasetDict (ignored for a single Dataset or files)")
    prompt_field: str = Field("prompt", description="field holding the prompt text (used when messages_field is empty)")
    messages_field: str = Field(
        "", description="field holding chat messages [{role, content}, ...] instead of a prompt text"
    )
    reference_field: str = Field(
        "answer", description="field holding the reference answer given to the reward; empty = none"
    )
    metadata_fields: list[str] = Field(
        default_factory=list, description="fields passed through to the reward plugins as the item's metadata"
    )
    task: str = Field(
        "math_verify",
        description="task name sent to the reward service with every prompt (it picks "
        "the plugin: reward.task_plugins, or the plugin of that name)",
    )
    task_field: str = Field("", description="field holding a per-row task name (overrides task when present)")
    system_prompt: str = Field("", description="system message put before every prompt (empty = none)")
    chat_template: Literal["auto", "always", "never"] = Field(
        "auto",
        description="apply the tokenizer's chat template: auto = when the tokenizer has one; always = fail "
        "at start if it has none; never = raw text",
    )
    tokenizer: str = Field(
        "", description="tokenizer folder; empty = the tokenizer of the announced weights (the model being trained)"
    )
    max_prompt_tokens: int = Field(
        1024,
        ge=1,
        description="prompts with more tokens are skipped and counted (prompts_skipped_too_long), never truncated",
    )
    shuffle: bool = Field(True, description="a fresh seeded permutation of the rows every epoch")
    seed: int = Field(0, description="seed of the permutation")
    epochs: int | None = Field(None, ge=1, description="passes over the dataset; null = repeat forever")
    start: int = Field(0, ge=0, description="use rows from this index (e.g. leave the first rows for evaluation)")
    stop: int | None = Field(None, ge=1, description="use rows before this index (null = to the end)")


# ------------------------------------------------------------------------------------------------
# reading rows


def _detect(path: Path) -> str:
    if path.is_dir():
        if (
            (path / "dataset_info.json").is_file()
            or (path / "dataset_dict.json").is_file()
            or (path / "state.json").is_file()
        ):
            return "hf_disk"
        kinds = {
            _detect(p) for p in path.iterdir() if p.is_file() and p.suffix in (".jsonl", ".json", ".parquet", ".csv")
        }
        if len(kinds) != 1:
            raise DatasetError(
                f"{path}: a folder must hold .jsonl, .parquet or .csv files of one kind, or a dataset "
                f"saved with save_to_disk (found {sorted(kinds) or 'none'})"
            )
        return kinds.pop()
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".csv":
        return "csv"
    raise DatasetError(
        f"{path}: cannot tell the format from the suffix {suffix!r}; set format to one of {', '.join(FORMATS)}"
    )


def _files(path: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in suffixes)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for f in _files(path, (".jsonl", ".json")):
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{f}:{n}: not a JSON object per line ({e})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{f}:{n}: a line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for f in _files(path, (".parquet",)):
        rows.extend(pq.read_table(f).to_pylist())
    return rows


def _read_csv(path: Path) -> list[dict]:
    rows = []
    for f in _files(path, (".csv",)):
        with open(f, newline="", encoding="utf-8") as fh:
            rows.extend(dict(r) for r in csv.DictReader(fh))
    return rows


def _read_hf_disk(path: Path, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"{path} is a Hugging Face dataset folder; reading it needs the `datasets` package (pip install datasets)"
        ) from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DatasetError(f"{path}: no split {split!r}; splits: {', '.join(ds)}")
        ds = ds[split]
    return ds.to_list()


def read_rows(cfg: DatasetConfig) -> list[dict]:
    """Every row of the dataset (after ``start``/``stop``), as dicts."""
    path = Path(cfg.path)
    if not path.exists():
        raise DatasetError(
            f"dataset {path} does not exist: fix dataset.path (a relative path is read from {Path.cwd()})"
        )
    fmt = _detect(path) if cfg.format == "auto" else cfg.format
    readers = {
        "jsonl": _read_jsonl,
        "parquet": _read_parquet,
        "csv": _read_csv,
        "hf_disk": lambda p: _read_hf_disk(p, cfg.split),
    }
    every = readers[fmt](path)
    rows = every[cfg.start : cfg.stop]
    if not rows:
        if not every:
            raise DatasetError(f"dataset {path} has no rows")
        which = f"dataset.start = {cfg.start}" + (f" with dataset.stop = {cfg.stop}" if cfg.stop is not None else "")
        raise DatasetError(
            f"dataset {path} has {len(every)} rows, so {which} leaves none: use a start below "
            f"{len(every)}" + (" and a stop above it" if cfg.stop is not None else "")
        )
    needed = [cfg.messages_field or cfg.prompt_field] + ([cfg.reference_field] if cfg.reference_field else [])
    needed += cfg.metadata_fields
    for i, row in enumerate(rows):
        missing = [f for f in needed if f not in row]
        if missing:
            raise DatasetError(
                f"dataset {path}, row {cfg.start + i}: no field {missing[0]!r} (fields: "
                f"{', '.join(sorted(row))}); set the field mapping (prompt_field, messages_field, "
                "reference_field, metadata_fields)"
            )
    return rows


# ------------------------------------------------------------------------------------------------
# rows -> prompt records


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of ``messages`` under the tokenizer's chat template, with the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(ids, "keys"):  # a BatchEncoding from transformers versions that ignore return_dict
        ids = ids["input_ids"]
    return [int(i) for i in ids]


class PromptBuilder:
    """Turns dataset rows into prompt records with the model's tokenizer."""

    def __init__(self, cfg: DatasetConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if cfg.chat_template == "always" and not has_template:
            name = getattr(tokenizer, "name_or_path", "") or "the built-in tiny model's"
            raise DatasetError(
                f"dataset.chat_template = 'always' but the tokenizer ({name}) has no chat template; "
                "use 'never' (or 'auto') for a base model, or set dataset.tokenizer to a folder "
                "with one"
            )
        self.use_template = cfg.chat_template == "always" or (cfg.chat_template == "auto" and has_template)

    def messages(self, row: dict) -> list[dict]:
        cfg = self.cfg
        if cfg.messages_field:
            msgs = row[cfg.messages_field]
            if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in msgs
            ):
                raise DatasetError(f"field {cfg.messages_field!r} must be a list of {{role, content}} messages")
            msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
        else:
            msgs = [{"role": "user", "content": str(row[cfg.prompt_field])}]
        if cfg.system_prompt and (not msgs or msgs[0]["role"] != "system"):
            msgs = [{"role": "system", "content": cfg.system_prompt}] + msgs
        return msgs

    def build(self, row: dict) -> PromptEntry | None:
        """The record of one row, or None when it is longer than ``max_prompt_tokens``."""
        cfg = self.cfg
        msgs = self.messages(row)
        if self.use_template:
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids = chat_ids(self.tok, msgs)
        else:
            text = "\n\n".join(m["content"] for m in msgs)
            ids = list(self.tok(text)["input_ids"])
        if len(ids) > cfg.max_prompt_tokens:
            return None
        task = str(row.get(cfg.task_field) or cfg.task) if cfg.task_field else cfg.task
        reference = "" if not cfg.reference_field or row[cfg.reference_field] is None else str(row[cfg.reference_field])
        return PromptEntry(
            text=text,
            reference=reference,
            task=task,
            prompt_ids=ids,
            metadata={k: row[k] for k in cfg.metadata_fields},
            messages=msgs if self.use_template else None,
        )


def sample_rows(n: int, first: int = 8, spread: int = 24) -> list[int]:
    """The rows a start-up check looks at: the first ``first``, and ``spread`` more spaced evenly over all
    ``n`` (a dataset's odd rows are seldom at its start)."""
    return sorted(set(range(min(first, n))) | set(range(0, n, max(1, -(-n // spread)))))


def check_dataset(cfg: DatasetConfig, tokenizer, rows: list[dict] | None = None, first: int = 8) -> list[dict]:
    """The start-up check of a dataset (``relay up`` before anything starts, and the broker): its rows
    read and their field mapping checked (:func:`read_rows`), the tokenizer's chat template when
    ``chat_template = "always"``, and a sample of rows (:func:`sample_rows`: the first ``first`` and some
    spread over the rest) built into prompts with ``tokenizer``, whose text must survive it: the system
    prompt, each row's prompt and its reference (:func:`check_encodes`; text the tokenizer cannot spell
    would be dropped silently, and a reference the model cannot write never matches). Returns the rows;
    raises :class:`DatasetError`."""
    rows = read_rows(cfg) if rows is None else rows
    builder = PromptBuilder(cfg, tokenizer)
    fix = "or fix those rows"
    for i in sample_rows(len(rows), first):
        entry = builder.build(rows[i])
        if entry is None:  # too long: skipped (and counted) when it comes
            continue
        if cfg.system_prompt:
            check_encodes(tokenizer, cfg.system_prompt, entry.prompt_ids, "dataset.system_prompt")
        where = f"row {cfg.start + i}"
        for m in builder.messages(rows[i]):
            if m["content"] != cfg.system_prompt:
                check_encodes(tokenizer, str(m["content"]), entry.prompt_ids, f"{where}'s prompt", fix)
        if entry.reference:
            check_encodes(
                tokenizer,
                entry.reference,
                encode_text(tokenizer, entry.reference),
                f"{where}'s reference {entry.reference[:40]!r}",
                fix,
            )
    return rows


def prompt_tokens(cfg: DatasetConfig, tokenizer, rows: list[dict]) -> list[int]:
    """The prompt length in tokens of the rows :func:`check_dataset` looks at (those within max_prompt_tokens)."""
    builder = PromptBuilder(cfg, tokenizer)
    return [len(e.prompt_ids) for e in (builder.build(rows[i]) for i in sample_rows(len(rows))) if e is not None]


def encode_text(tokenizer, text: str) -> list[int]:
    """``text``'s token ids, without special tokens (a completion's, as the model would write it)."""
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def check_encodes(tokenizer, text: str, ids: list[int], what: str, fix: str = "or leave it empty") -> None:
    """``text`` must survive into ``ids``: decoding them gives it back (whitespace aside). A tokenizer
    that cannot spell it (the built-in tiny model knows only digits, '+' and '=') would drop it
    silently: the stored text would have it, the tokens the model sees would not."""
    decoded = "".join(tokenizer.decode(ids, skip_special_tokens=True).split())
    if "".join(text.split()) not in decoded:
        name = getattr(tokenizer, "name_or_path", "") or "the built-in tiny model's"
        raise DatasetError(
            f"{what} does not survive the tokenizer ({name}): decoding its token ids gives "
            f"{decoded[:80]!r} without {' '.join(text.split())[:60]!r}; use a model whose tokenizer "
            f"can spell it (the built-in tiny model knows only digits, '+' and '='), {fix}"
        )


# ------------------------------------------------------------------------------------------------
# order and position


@dataclass(frozen=True)
class Position:
    """The next prompt to feed: row ``order(epoch)[index]``; ``fed`` and ``skipped`` count so far."""

    epoch: int = 0
    index: int = 0
    fed: int = 0
    skipped: int = 0

    def as_fields(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "fed": self.fed, "skipped_too_long": self.skipped}

    @classmethod
    def from_fields(cls, f: dict) -> "Position":
        g = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in f.items()}
        return cls(g.get("epoch", 0), g.get("index", 0), g.get("fed", 0), g.get("skipped_too_long", 0))


def epoch_order(n: int, epoch: int, shuffle: bool, seed: int) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


class DatasetSource:
    """Prompt records of a dataset in epoch order, from any position."""

    def __init__(self, cfg: DatasetConfig, tokenizer, rows: list[dict] | None = None):
        self.cfg = cfg
        self.rows = read_rows(cfg) if rows is None else rows
        self.builder = PromptBuilder(cfg, tokenizer)
        self._order: tuple[int, list[int]] | None = None

    def order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(len(self.rows), epoch, self.cfg.shuffle, self.cfg.seed))
        return self._order[1]

    def exhausted(self, pos: Position) -> bool:
        return self.cfg.epochs is not None and pos.epoch >= self.cfg.epochs

    def take(self, k: int, pos: Position) -> tuple[list[tuple[int, int, PromptEntry]], Position]:
        """Up to ``k`` records from ``pos`` on, each with its (epoch, row); the position after them.
        Too-long prompts are skipped and counted in the position. Fewer than ``k`` at the end of the
        last epoch."""
        out = []
        epoch, index, fed, skipped = pos.epoch, pos.index, pos.fed, pos.skipped
        in_a_row = 0  # skipped one after another: all of them means no row fits
        while len(out) < k and not self.exhausted(Position(epoch, index)):
            if index >= len(self.rows):
                epoch, index = epoch + 1, 0
                continue
            row = self.order(epoch)[index]
            index += 1
            rec = self.builder.build(self.rows[row])
            if rec is None:
                skipped += 1
                in_a_row += 1
                if in_a_row > len(self.rows):
                    raise DatasetError(
                        f"every prompt of {self.cfg.path} is longer than max_prompt_tokens "
                        f"({self.cfg.max_prompt_tokens})"
                    )
                continue
            fed += 1
            in_a_row = 0
            out.append((epoch, row, rec))
        return out, Position(epoch, index, fed, skipped)
