"""The run's bearer tokens: ``relay up`` makes one per run for the reward service, so that its ``POST /score``
answers only the run's generators (a request without it gets 401), keeps it in
``runs/<id>/secrets/reward.token`` (0600, the folder 0700) for ``relay up --resume``, and hands it to the
services through their environment (``RELAY_AUTH_TOKEN`` to the reward service, ``RELAY_REWARD_TOKEN`` to the
generators: deploy/launcher/environment.py ``split_secrets``), never a config file.

A token given by the operator (``reward.auth_token`` in the config file, ``RELAY_AUTH_TOKEN``, ``--set``) wins
over the generated one and is the one kept; ``reward.auth_token = ""`` turns the check off (then the service
must stay on a loopback host, reward_service/config.py). Compose and Kubernetes get theirs from
``relay secrets`` (deploy/provision.py: ``relay.env``, the Secret ``relay-reward-token``).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from deploy.launcher.run_secrets import _private_dir, _write_private, secrets_dir


def new_token() -> str:
    """A fresh bearer token: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def reward_token_path(run_dir: Path) -> Path:
    return secrets_dir(run_dir) / "reward.token"


def keep_reward_token(run_dir: Path, token: str) -> None:
    """Record the run's reward token (0600) for a resume; nothing when the run has none."""
    if token:
        _private_dir(secrets_dir(run_dir))
        _write_private(reward_token_path(run_dir), token + "\n")


def recorded_reward_token(run_dir: Path) -> str:
    """The token a run recorded ("" for a run without one, or from before runs had one)."""
    path = reward_token_path(run_dir)
    return path.read_text().strip() if path.is_file() else ""
