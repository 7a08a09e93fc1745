"""The OpenAI-compatible endpoint's key under ``relay up`` (docs/openai-endpoint.md, "The key").

The endpoint trains on what its callers send, so it needs a key (generators/config.py ``OpenAIConfig``).
When ``generator.openai`` is enabled and the operator gives none (``RELAY_OPENAI__API_KEY``) and does not
open it (``openai.open``), ``relay up`` makes one for the run. Like every token, it reaches the generators
through their environment, never a config file; the operator's copy is ``runs/<id>/secrets/openai.key``
(the folder 0700, the file 0600, beside the run's other secrets), which ``relay up --resume`` reads back,
so a harness keeps its key across a resume. The key itself is never printed.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from deploy.launcher.run_secrets import _private_dir, _write_private, secrets_dir


def openai_key_path(run_dir: Path) -> Path:
    return secrets_dir(run_dir) / "openai.key"


def endpoint_key(generator: dict, run_dir: Path) -> bool:
    """Give ``generator['openai']`` the run's key when the endpoint is enabled with none and not opened: the
    one in ``secrets/openai.key`` (a resumed run), else a new one. Returns whether the key is the run's own
    (:func:`endpoint_note` then keeps it in that file for the operator)."""
    oa = generator.get("openai")
    if not isinstance(oa, dict) or oa.get("enabled") is not True or oa.get("api_key") or oa.get("open") is True:
        return False
    path = openai_key_path(run_dir)
    oa["api_key"] = path.read_text().strip() if path.is_file() else secrets.token_urlsafe(32)
    return True


def endpoint_note(run_dir: Path, generator: dict, own_key: bool) -> str | None:
    """What ``relay up`` tells the operator about the endpoint (writing the run's key to its file first), or
    None when the endpoint is off."""
    oa = generator.get("openai")
    if not isinstance(oa, dict) or oa.get("enabled") is not True:
        return None
    where = (
        "each generator's URL is in its log (`OpenAI-compatible endpoint on ...`) and in the run's "
        "`openai_endpoint` events"
    )
    if oa.get("open") is True:
        return (
            f"warning: the OpenAI endpoint is open (generator.openai.open = true): anyone who reaches its port "
            f"samples from the model and trains it with the rewards they post; {where}"
        )
    if not own_key:
        return f"the OpenAI endpoint takes the api_key you configured (RELAY_OPENAI__API_KEY); {where}"
    path = openai_key_path(run_dir)
    _private_dir(secrets_dir(run_dir))
    _write_private(path, oa["api_key"] + "\n")
    return f"the OpenAI endpoint's key for this run is in {path} (the client's api_key); {where}"
