"""SmolLM2-135M-Instruct for the tests: the product's converter (deploy/models/smollm2.py), which
``make smollm2-demo`` runs too."""

from deploy.models.smollm2 import DEFAULT, GGUF, ROOT, build, gguf_dir

__all__ = ["DEFAULT", "GGUF", "ROOT", "build", "gguf_dir"]
