"""Who may send groups to the ingest: ZeroMQ CURVE keys and the allow-list that binds each producer's
public key to the generator ids it may use (docs/protocol.md 5.4, docs/security.md "Ingest").

Files, in the formats ``zmq.auth.create_certificates`` writes and ``zmq.auth.load_certificate`` reads:

    broker.key_secret      the broker's certificate (public and secret key): BrokerConfig.ingest_key_file
    broker.key             the broker's public key: GeneratorConfig.broker_public_key_file
    <generator>.key_secret a producer's certificate: GeneratorConfig.ingest_key_file
    clients.json           the allow-list: {"clients": [{"public_key": "<z85>", "generator_id": "<fnmatch
                           pattern>"}]}: BrokerConfig.ingest_clients_file

:func:`write_ingest_keys` makes a set of them (``relay up`` does, per run, and tests do).
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from broker.runtime.config import ConfigError

HOW_TO_MAKE_KEYS = (
    'make keys with `python -c "from broker.protocol.ingest_auth import write_ingest_keys; '
    "write_ingest_keys('keys', ['gen-0'])\"` (relay up does this per run), or set "
    'ingest_auth = "insecure" to accept unauthenticated producers'
)


class IngestAuthError(ConfigError):
    """A key file or the allow-list is missing or unreadable (a start-up error naming the field)."""


@dataclass(frozen=True)
class CurveClientKeys:
    """What a producer's socket needs: its own key pair and the broker's public key (z85 bytes)."""

    public: bytes
    secret: bytes
    server: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the broker (before ``connect``)."""
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self.public, self.secret, self.server


class AllowList:
    """Public key (z85) -> the generator id pattern that key may send as."""

    def __init__(self, patterns: dict[str, str]):
        self.patterns = patterns

    def allows_key(self, public_key_z85: str) -> bool:
        return public_key_z85 in self.patterns

    def allows(self, public_key_z85: str, generator_id: str) -> bool:
        pattern = self.patterns.get(public_key_z85)
        return pattern is not None and fnmatch.fnmatchcase(generator_id, pattern)


def _load(path: str, field: str, secret: bool) -> tuple[bytes, bytes | None]:
    if not path:
        raise IngestAuthError(f"{field} is not set; {HOW_TO_MAKE_KEYS}")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise IngestAuthError(
            f"{field} = {path!r} is not a readable ZeroMQ certificate ({e}); {HOW_TO_MAKE_KEYS}"
        ) from None
    if secret and secret_key is None:
        raise IngestAuthError(f"{field} = {path!r} holds no secret key (give the .key_secret file); {HOW_TO_MAKE_KEYS}")
    return public, secret_key


def load_server_keys(key_file: str, field: str = "ingest_key_file") -> tuple[bytes, bytes]:
    """The broker's (public, secret) key pair, z85."""
    public, secret = _load(key_file, field, secret=True)
    return public, secret


def load_client_keys(key_file: str, broker_public_key_file: str) -> CurveClientKeys:
    """A producer's keys: its certificate and the broker's public key."""
    public, secret = _load(key_file, "ingest_key_file", secret=True)
    server, _ = _load(broker_public_key_file, "broker_public_key_file", secret=False)
    return CurveClientKeys(public, secret, server)


def load_allow_list(path: str, field: str = "ingest_clients_file") -> AllowList:
    """The allow-list file; every entry a valid z85 CURVE public key and a non-empty pattern."""
    if not path:
        raise IngestAuthError(f"{field} is not set; {HOW_TO_MAKE_KEYS}")
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise IngestAuthError(
            f"{field} = {path!r} is not a readable JSON allow-list ({e}); {HOW_TO_MAKE_KEYS}"
        ) from None
    entries = doc.get("clients") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise IngestAuthError(f'{field} = {path!r} must be {{"clients": [{{"public_key": ..., "generator_id": ...}}]}}')
    patterns = {}
    for i, e in enumerate(entries):
        key = e.get("public_key") if isinstance(e, dict) else None
        pattern = e.get("generator_id") if isinstance(e, dict) else None
        if not isinstance(key, str) or len(key) != 40 or not isinstance(pattern, str) or not pattern:
            raise IngestAuthError(
                f"{field} = {path!r}: clients[{i}] needs public_key (40 z85 characters) and a "
                f"non-empty generator_id pattern"
            )
        try:
            zmq.utils.z85.decode(key)
        except ValueError:
            raise IngestAuthError(f"{field} = {path!r}: clients[{i}].public_key is not z85") from None
        patterns[key] = pattern
    return AllowList(patterns)


def _literal(generator_id: str) -> str:
    """An fnmatch pattern matching exactly ``generator_id`` (its ``*?[`` made literal)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in generator_id)


def write_ingest_keys(directory: str | Path, generator_ids: list[str], patterns: dict[str, str] | None = None) -> dict:
    """Write a broker certificate, one certificate per generator id and the allow-list binding each
    generator's key to exactly its id (or to ``patterns[id]``, an fnmatch pattern, e.g. one benchmark
    producer sending as any id: ``{"producer": "*"}``), into ``directory`` (made 0700; every file 0600).

    Returns the paths: ``broker_key_file`` (the broker's secret certificate), ``broker_public_key_file``,
    ``clients_file`` and ``generators`` (generator id -> its secret certificate)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    paths = {"generators": {}}
    _, paths["broker_key_file"] = zmq.auth.create_certificates(str(d), "broker")
    paths["broker_public_key_file"] = str(d / "broker.key")
    clients = []
    for gid in generator_ids:
        public_file, secret_file = zmq.auth.create_certificates(str(d), f"generator-{gid}")
        public, _ = zmq.auth.load_certificate(public_file)
        clients.append({"public_key": public.decode(), "generator_id": (patterns or {}).get(gid, _literal(gid))})
        paths["generators"][gid] = secret_file
    paths["clients_file"] = str(d / "clients.json")
    Path(paths["clients_file"]).write_text(json.dumps({"clients": clients}, indent=1))
    for f in d.iterdir():
        os.chmod(f, 0o600)
    return paths
