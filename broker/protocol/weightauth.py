"""Who may receive the weights: the run's **weights key**, held by the learner and the generators only.

It opens the two listeners that hand out weights (docs/security.md):

- the ``http`` transport's weight server (learner/weight_server.py serves, generators/weight_fetch.py
  fetches): every request carries ``Authorization: Bearer <token>``, the token derived from the key
  (:func:`bearer_token`);
- the ``collective`` transport's rendezvous (learner/broadcast.py, generators/weight_receive.py): a
  join proves it holds the key by an HMAC over the learner's fresh challenge (:func:`join_proof`), and
  the learner proves it back (:func:`accept_proof`), before anything else is said.

The key is 32 random bytes, written as 64 hex digits (one line) in a file of mode 0600
(:func:`write_key_file`; ``relay up`` writes ``runs/<id>/secrets/weights.key``; ``weights.key_file``).
It is not the announcement key: holding it lets one *read* versions, never sign one (the learner's
Ed25519 key does that, broker/protocol/signing.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from broker.runtime.config import ConfigError

if TYPE_CHECKING:
    from broker.protocol.weights_config import TransportConfig

KEY_BYTES = 32
TOKEN_CONTEXT = b"relay weights http v2\0"
JOIN_CONTEXT = "relay-collective-join-v1"
ACCEPT_CONTEXT = "relay-collective-accept-v1"


class WeightsKeyError(ConfigError):
    """The weights key cannot be used (missing, unreadable, not 64 hex digits): a start-up error."""


def write_key_file(path: str | Path) -> Path:
    """A new random key in ``path`` (created with mode 0600; an existing file is kept, and must be a key)."""
    path = Path(path)
    if path.exists():
        read_key_file(path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")
    return path


def read_key_file(path: str | Path) -> bytes:
    path = Path(path)
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise WeightsKeyError(f"cannot read the weights key {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise WeightsKeyError(f"{path} must hold {KEY_BYTES} bytes as {2 * KEY_BYTES} hex digits (one line)")
    return key


def weights_key(auth: str, key_file: str, transport: TransportConfig) -> bytes | None:
    """The key a learner or a generator opens (or joins) its weight listener with (``weights.auth``,
    ``weights.key_file``), read only for a transport with a listener (``listens``: http, collective); None
    otherwise, or with ``weights.auth = "insecure"`` (whoever reaches the port receives the weights)."""
    if not transport.listens or auth == "insecure":
        return None
    if not key_file:
        raise WeightsKeyError(
            f"weights.transport = {transport.type!r} with weights.auth = 'key' needs weights.key_file (the "
            f"run's weights key, 64 hex digits; `relay up` writes runs/<id>/secrets/weights.key), or "
            f"weights.auth = 'insecure' to let whoever reaches the port receive the weights"
        )
    return read_key_file(key_file)


def bearer_token(key: bytes | None, run_id: str) -> str | None:
    """The http weight server's bearer token: HMAC-SHA256 of the run id under the weights key (hex), or
    None without a key (the server asks for no token)."""
    if key is None:
        return None
    return hmac.new(key, TOKEN_CONTEXT + run_id.encode(), hashlib.sha256).hexdigest()


def _mac(key: bytes, fields: list[str]) -> str:
    data = b"".join(str(len(f.encode())).encode() + b":" + f.encode() + b"," for f in fields)
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def join_proof(key: bytes, run_id: str, challenge: str, nonce: str, generator: str, session: str) -> str:
    """A collective join's proof of the key: HMAC-SHA256 over netstrings of the context, the run id, the
    learner's challenge, the generator's nonce, its id and its session (hex)."""
    return _mac(key, [JOIN_CONTEXT, run_id, challenge, nonce, generator, session])


def accept_proof(key: bytes, run_id: str, challenge: str, nonce: str, generator: str, session: str) -> str:
    """The learner's answer: the same fields under the accept context (the generator checks it)."""
    return _mac(key, [ACCEPT_CONTEXT, run_id, challenge, nonce, generator, session])


def same(a: str, b: str) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(a.encode(), b.encode())
