"""Signed announcements: the learner signs each weight announcement with the run's Ed25519 private key;
the generators and the broker verify it with the public key, so that neither whoever can only write to
Redis nor whoever stole a generator's (or the broker's) files can make a generator load weights of their
own (docs/security.md, "Redis and announcements").

The key pair (:func:`write_key_pair`; ``relay up`` writes ``runs/<id>/secrets/announce.key`` and
``announce.pub``, ``relay secrets`` the same two files):

- the **private key**, PKCS#8 PEM (``-----BEGIN PRIVATE KEY-----``), mode 0600: the learner's alone
  (``learner.announce_key_file``);
- the **public key**, the raw 32-byte Ed25519 key (RFC 8032) as 64 lowercase hex digits on one line:
  the broker's, the generators', the launcher's (``announce_public_key_file``).

The signature is Ed25519 (pure, RFC 8032) of :func:`canonical_bytes` (every field of the announcement
and the run id, each as a netstring, so a producer in another language computes the same bytes;
docs/protocol.md 6.1.1), as 128 lowercase hex digits. A verifier caches what it has verified (an
announcement is read before every batch; one verification costs ~0.1 ms).

Runs made before the Ed25519 signatures held one HMAC key (64 hex digits in ``announce.key``) that
every verifier needed, so every generator could sign: such a key is refused with a message that says so
(docs/security.md, "Runs from before Ed25519").
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from broker.protocol.codec import SCHEMA_VERSION
from broker.protocol.messages import Announcement
from broker.runtime.config import ConfigError

log = logging.getLogger(__name__)

CONTEXT = "relay-announce-v2"  # the first netstring: what the key signs (and the format's version: 2 = Ed25519)
COLLECTIVE_CONTEXT = "relay-collective-v2"  # the same for a collective (or ipc) broadcast's trailer
PUBLIC_BYTES = 32
SIGNATURE_HEX = 128  # an Ed25519 signature: 64 bytes
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_VERIFIED_CACHE = 4096  # (message, signature) pairs a verifier remembers


class AnnounceKeyError(ConfigError):
    """An announcement key that cannot be used (missing, unreadable, malformed, from before Ed25519):
    a start-up error."""


class AnnounceVerifier:
    """The run's public key: verifies announcements and broadcast trailers (the broker, the generators)."""

    def __init__(self, public: Ed25519PublicKey):
        self.public = public
        self.public_hex = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
        self._verify = functools.lru_cache(maxsize=_VERIFIED_CACHE)(self._verify_uncached)

    def _verify_uncached(self, message: bytes, sig: str) -> bool:
        if len(sig) != SIGNATURE_HEX:
            return False
        try:
            self.public.verify(bytes.fromhex(sig), message)
            return True
        except (InvalidSignature, ValueError):
            return False

    def verify(self, message: bytes, sig: str) -> bool:
        """Whether ``sig`` (hex) is the private key's signature of ``message``."""
        return self._verify(bytes(message), str(sig))


class AnnounceSigner(AnnounceVerifier):
    """The run's private key: signs (the learner). It verifies too, with its public half."""

    def __init__(self, private: Ed25519PrivateKey):
        super().__init__(private.public_key())
        self._private = private

    def sign(self, message: bytes) -> str:
        return self._private.sign(message).hex()

    @classmethod
    def generate(cls) -> "AnnounceSigner":
        return cls(Ed25519PrivateKey.generate())


def _write_new(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def write_key_pair(private_path: str | Path, public_path: str | Path) -> tuple[Path, Path]:
    """A new key pair: the private key into ``private_path`` (PEM, mode 0600), the public key into
    ``public_path`` (64 hex digits, mode 0644). An existing private key is kept (and must still be a
    key: a pre-Ed25519 HMAC key is refused), its public half written again."""
    private_path, public_path = Path(private_path), Path(public_path)
    if private_path.exists():
        signer = read_signer(private_path)
    else:
        signer = AnnounceSigner.generate()
        pem = signer._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        _write_new(private_path, pem, 0o600)
    if not public_path.exists() or public_path.read_text().strip() != signer.public_hex:
        _write_new(public_path, (signer.public_hex + "\n").encode(), 0o644)
    return private_path, public_path


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise AnnounceKeyError(
            f"cannot read the announcement {what} {path}: {getattr(e, 'strerror', None) or e}"
        ) from None


def _pre_ed25519(path: Path) -> AnnounceKeyError:
    return AnnounceKeyError(
        f"{path} holds 64 hex digits: an HMAC announcement key of a run made before announcements were signed with "
        f"Ed25519 (every generator held that key, so any of them could sign). Such a run cannot be continued; "
        f"make a new key pair (relay up does for a new run; relay secrets --force for Compose/Kubernetes) "
        f"(docs/security.md, 'Runs from before Ed25519')"
    )


def read_signer(path: str | Path) -> AnnounceSigner:
    """The learner's private key from ``path`` (PKCS#8 PEM)."""
    path = Path(path)
    text = _read(path, "private key")
    if _HEX64.match(text.strip()):
        raise _pre_ed25519(path)
    try:
        key = serialization.load_pem_private_key(text.encode(), password=None)
    except (ValueError, TypeError) as e:
        raise AnnounceKeyError(f"{path} is not an unencrypted PKCS#8 PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AnnounceKeyError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return AnnounceSigner(key)


def read_verifier(path: str | Path) -> AnnounceVerifier:
    """The run's public key from ``path`` (64 hex digits on one line)."""
    path = Path(path)
    text = _read(path, "public key").strip()
    if text.startswith("-----BEGIN PRIVATE KEY"):
        raise AnnounceKeyError(
            f"{path} is the run's PRIVATE announcement key: a broker or a generator needs only "
            f"the public key (announce.pub); whoever holds the private key can sign versions"
        )
    if not _HEX64.match(text):
        raise AnnounceKeyError(f"{path} must hold the Ed25519 public key as {2 * PUBLIC_BYTES} hex digits (one line)")
    return AnnounceVerifier(Ed25519PublicKey.from_public_bytes(bytes.fromhex(text)))


def _insecure() -> None:
    log.warning(
        "announce_auth = insecure: weight announcements are neither signed nor checked; anyone who can "
        "write to Redis can make the generators load weights of their choosing"
    )


def announce_signer(auth: str, key_file: str) -> AnnounceSigner | None:
    """The learner's signing key (its ``announce_auth`` and ``announce_key_file``), or None with
    ``announce_auth = "insecure"`` (announcements unsigned)."""
    if auth == "insecure":
        _insecure()
        return None
    if not key_file:
        raise AnnounceKeyError(
            "announce_auth = 'ed25519' needs announce_key_file (the run's private announcement key, "
            "PEM; `relay up` writes runs/<id>/secrets/announce.key), or announce_auth = 'insecure' "
            "to turn signatures off"
        )
    return read_signer(key_file)


def announce_verifier(auth: str, public_key_file: str) -> AnnounceVerifier | None:
    """The key a broker or a generator verifies announcements with (its ``announce_auth`` and
    ``announce_public_key_file``), or None with ``announce_auth = "insecure"`` (nothing checked)."""
    if auth == "insecure":
        _insecure()
        return None
    if not public_key_file:
        raise AnnounceKeyError(
            "announce_auth = 'ed25519' needs announce_public_key_file (the run's public "
            "announcement key, 64 hex digits; `relay up` writes runs/<id>/secrets/announce.pub), "
            "or announce_auth = 'insecure' to turn the check off"
        )
    return read_verifier(public_key_file)


def _netstring(value: str) -> bytes:
    b = value.encode()
    return str(len(b)).encode() + b":" + b + b","


def canonical_bytes(run_id: str, a: Announcement) -> bytes:
    """What the signature covers, in this order: the context, the schema version, the run id, the
    version (decimal), the hash, the path, the url, published_at (``%.6f``), each a netstring; then
    the tensor digest, only when the announcement has one; then, for a LoRA version only,
    ``base:<base>:<base_digest>``."""
    fields = [
        CONTEXT,
        str(SCHEMA_VERSION),
        run_id,
        str(int(a.version)),
        a.hash,
        a.path,
        a.url,
        f"{float(a.published_at):.6f}",
    ] + ([a.digest] if a.digest else [])
    if a.base is not None:
        fields.append(f"base:{int(a.base)}:{a.base_digest}")
    return b"".join(_netstring(f) for f in fields)


def signature(key: AnnounceSigner, run_id: str, a: Announcement) -> str:
    return key.sign(canonical_bytes(run_id, a))


def signed(key: AnnounceSigner | None, run_id: str, a: Announcement) -> Announcement:
    """``a`` with its signature (unchanged without a key)."""
    if key is not None:
        a.sig = signature(key, run_id, a)
    return a


def check(key: AnnounceVerifier, run_id: str, a: Announcement) -> str | None:
    """Why ``a`` is not the learner's (``unsigned`` or ``bad_signature``), or None when it is."""
    if not a.sig:
        return "unsigned"
    return None if key.verify(canonical_bytes(run_id, a), a.sig) else "bad_signature"


def _collective_bytes(run_id: str, version: int, digest: str, header_sha256: str) -> bytes:
    fields = [COLLECTIVE_CONTEXT, str(SCHEMA_VERSION), run_id, str(int(version)), digest, header_sha256]
    return b"".join(_netstring(f) for f in fields)


def collective_signature(key: AnnounceSigner, run_id: str, version: int, digest: str, header_sha256: str) -> str:
    """The signature that closes a version broadcast over the collective (or ipc) transport
    (broker/protocol/collective.py): of its context, the schema version, the run id, the version, the
    tensor digest and the sha256 of the header it came with, each a netstring."""
    return key.sign(_collective_bytes(run_id, version, digest, header_sha256))


def check_collective(
    key: AnnounceVerifier, run_id: str, version: int, digest: str, header_sha256: str, sig: str
) -> str | None:
    """Why a collective trailer is not the learner's (``unsigned`` or ``bad_signature``), or None."""
    if not sig:
        return "unsigned"
    return None if key.verify(_collective_bytes(run_id, version, digest, header_sha256), sig) else "bad_signature"
