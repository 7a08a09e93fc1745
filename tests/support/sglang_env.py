"""Where SGLang's own environment is (``make sglang-env`` builds it under .cache/sglang-venv), and the marks of
the tests that run a real SGLang server from it: ``sglang`` and ``slow``, skipped, saying why, when it is absent.
``make test`` deselects them (``-m "not sglang"``); ``make test-sglang`` builds the environment and runs them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.services import ROOT

SGLANG_VENV = ROOT / ".cache" / "sglang-venv"


def sglang_python() -> Path | None:
    """The interpreter of a built SGLang environment (``RELAY_SGLANG_PYTHON``, else .cache/sglang-venv), or None."""
    given = os.environ.get("RELAY_SGLANG_PYTHON")
    if given:
        return Path(given) if Path(given).is_file() else None
    python = SGLANG_VENV / "bin" / "python"
    return python if (SGLANG_VENV / ".installed").is_file() and python.is_file() else None


def needs_sglang() -> list:
    return [
        pytest.mark.sglang,
        pytest.mark.slow,
        pytest.mark.skipif(
            sglang_python() is None,
            reason="SGLang's own environment is not built (`make test-sglang` builds .cache/sglang-venv and runs "
            "these tests; RELAY_SGLANG_PYTHON names another)",
        ),
    ]
