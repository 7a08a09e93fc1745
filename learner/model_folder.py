"""The start-up check of a Hugging Face model folder (no torch, no transformers): ``relay up`` runs it
before anything starts, the learner before it loads the model. One line per mistake, naming the fix."""

from __future__ import annotations

from pathlib import Path


class ModelFolderError(ValueError):
    """A model folder that cannot be trained; the message names what is missing and how to fix it."""


# weights: one file, or shards with their index
WEIGHT_GLOBS = ("model.safetensors", "model-*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin")
# a tokenizer transformers can load: the fast tokenizer file, a sentencepiece model or a BPE vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def check_model_folder(model: str) -> Path:
    """``model`` ('tiny', or a folder with config.json, weights and a tokenizer); its resolved path
    ('tiny' as is). Raises :class:`ModelFolderError`."""
    if model == "tiny":
        return Path(model)
    path = Path(model)
    if not path.is_dir():
        raise ModelFolderError(f"model folder {model!r} does not exist (give a local Hugging Face folder, or 'tiny')")
    if not (path / "config.json").is_file():
        raise ModelFolderError(f"model folder {model!r} has no config.json: not a Hugging Face model folder")
    if not any(any(path.glob(g)) for g in WEIGHT_GLOBS):
        raise ModelFolderError(
            f"model folder {model!r} has a config.json but no weights (model.safetensors, "
            "model-*-of-*.safetensors or pytorch_model.bin): download the whole model, e.g. "
            f"`huggingface-cli download NAME --local-dir {model}`"
        )
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelFolderError(
            f"model folder {model!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}): save the "
            "tokenizer into it (tokenizer.save_pretrained) or download the whole model"
        )
    return path.resolve()


# config.json keys that hold a model's context length (positions), the usual one first
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_length(model: str) -> int | None:
    """The most positions ``model`` ('tiny', or a checked folder) takes: prompt and completion together,
    from its config.json (a multimodal model's ``text_config``); None when the config does not say."""
    import json

    if model == "tiny":
        from learner.tiny_model import MAX_POSITIONS

        return MAX_POSITIONS
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (cfg, cfg.get("text_config") or {}):
        for k in CONTEXT_KEYS:
            if isinstance(c.get(k), int) and c[k] > 0:
                return c[k]
    return None
