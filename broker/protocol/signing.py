"""Signed announcements: the learner signs each weight announcement with a key that generators and
the broker share (HMAC-SHA256), so that whoever can only write to Redis cannot make a generator
load weights of their own (docs/security.md, "Redis and announcements").

The key is 32 random bytes, written as 64 hex digits (one line) in a file of mode 0600
(:func:`write_key_file`; ``relay up`` writes ``runs/<id>/secrets/announce.key``). The signature
is the hex HMAC-SHA256 of :func:`canonical_bytes`: every field of the announcement and the run id,
each as a netstring, so a producer in another language computes the same bytes (docs/protocol.md).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from broker.protocol.codec import SCHEMA_VERSION
from broker.protocol.messages import Announcement
from broker.runtime.config import ConfigError

log = logging.getLogger(__name__)

CONTEXT = "relay-announce-v1"  # the first netstring: what the key signs (and the format's version)
KEY_BYTES = 32


class AnnounceKeyError(ConfigError):
    """The announcement key cannot be used (missing, unreadable, not 64 hex digits): a start-up error."""


def write_key_file(path: str | Path) -> Path:
    """A new random key in ``path`` (created with mode 0600; an existing file is kept as it is)."""
    path = Path(path)
    if path.exists():
        read_key_file(path)  # an existing key must still be a key
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
    except OSError as e:
        raise AnnounceKeyError(f"cannot read the announcement key {path}: {e.strerror}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise AnnounceKeyError(f"{path} must hold {KEY_BYTES} bytes as {2 * KEY_BYTES} hex digits (one line)")
    return key


def announce_key(auth: str, key_file: str) -> bytes | None:
    """The key a service signs or verifies announcements with (its ``announce_auth`` and
    ``announce_key_file`` fields), or None with ``announce_auth = "insecure"`` (nothing checked)."""
    if auth == "insecure":
        log.warning("announce_auth = insecure: weight announcements are neither signed nor checked; anyone who can "
                    "write to Redis can make the generators load weights of their choosing")
        return None
    if not key_file:
        raise AnnounceKeyError("announce_auth = 'hmac' needs announce_key_file (a file holding the run's announcement "
                               "key, 64 hex digits; `relay up` writes runs/<id>/secrets/announce.key), or "
                               "announce_auth = 'insecure' to turn the check off")
    return read_key_file(key_file)


def _netstring(value: str) -> bytes:
    b = value.encode()
    return str(len(b)).encode() + b":" + b + b","


def canonical_bytes(run_id: str, a: Announcement) -> bytes:
    """What the signature covers, in this order: the context, the schema version, the run id, the
    version (decimal), the hash, the path, the url, published_at (``%.6f``), each a netstring; then
    the tensor digest, only when the announcement has one (so signatures made before digests existed
    still check); then, for a LoRA version only, ``base:<base>:<base_digest>``."""
    fields = [CONTEXT, str(SCHEMA_VERSION), run_id, str(int(a.version)), a.hash, a.path, a.url,
              f"{float(a.published_at):.6f}"] + ([a.digest] if a.digest else [])
    if a.base is not None:
        fields.append(f"base:{int(a.base)}:{a.base_digest}")
    return b"".join(_netstring(f) for f in fields)


def signature(key: bytes, run_id: str, a: Announcement) -> str:
    return hmac.new(key, canonical_bytes(run_id, a), hashlib.sha256).hexdigest()


def signed(key: bytes | None, run_id: str, a: Announcement) -> Announcement:
    """``a`` with its signature (unchanged without a key)."""
    if key is not None:
        a.sig = signature(key, run_id, a)
    return a


def check(key: bytes, run_id: str, a: Announcement) -> str | None:
    """Why ``a`` is not the learner's (``unsigned`` or ``bad_signature``), or None when it is."""
    if not a.sig:
        return "unsigned"
    return None if hmac.compare_digest(a.sig, signature(key, run_id, a)) else "bad_signature"


COLLECTIVE_CONTEXT = "relay-collective-v1"  # what the key signs in a collective broadcast's trailer


def collective_signature(key: bytes, run_id: str, version: int, digest: str, header_sha256: str) -> str:
    """The HMAC that closes a version broadcast over the collective transport
    (broker/protocol/collective.py): its context, the schema version, the run id, the version, the
    tensor digest and the sha256 of the header it came with, each a netstring."""
    fields = [COLLECTIVE_CONTEXT, str(SCHEMA_VERSION), run_id, str(int(version)), digest, header_sha256]
    return hmac.new(key, b"".join(_netstring(f) for f in fields), hashlib.sha256).hexdigest()


def check_collective(key: bytes, run_id: str, version: int, digest: str, header_sha256: str, sig: str) -> str | None:
    """Why a collective trailer is not the learner's (``unsigned`` or ``bad_signature``), or None."""
    if not sig:
        return "unsigned"
    good = collective_signature(key, run_id, version, digest, header_sha256)
    return None if hmac.compare_digest(sig, good) else "bad_signature"
