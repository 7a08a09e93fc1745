"""The run's ingest keys (CURVE, docs/protocol.md 5.4), as ``relay up`` writes them into
``runs/<id>/secrets/ingest/`` (folder 0700, files 0600), and the check that the keys the configs name
fit together before anything starts.

``relay up`` writes only the files the configs use: the broker's certificate (``broker.key_secret``,
its public half ``broker.key``) unless ``broker.ingest_key_file`` and ``generator.broker_public_key_file``
both name the user's own; one certificate per generator (``generator-gen-<i>.key_secret``) unless
``generator.ingest_key_file`` names one for all; the allow-list ``clients.json`` unless
``broker.ingest_clients_file`` is the user's own; and one certificate per producer of
``relay up --producers N`` (``producer-<i>.key_secret``), added to the run's allow-list bound to exactly
its id. A file already there is kept (``relay up --resume``). A run configured with keys of its own
entirely (docs/protocol.md section 12, "Your own keys") gets no key set of the run's.
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path


def ingest_key_dir(run_dir: Path) -> Path:
    return run_dir / "secrets" / "ingest"


def _certificate(d: Path, name: str) -> str:
    """``d/<name>.key_secret`` (and its public ``<name>.key``), made when absent; returns its public key."""
    import zmq.auth

    if not (d / f"{name}.key_secret").is_file():
        zmq.auth.create_certificates(str(d), name)
    public, _ = zmq.auth.load_certificate(str(d / f"{name}.key"))
    return public.decode()


def write_run_ingest_keys(
    run_dir: Path, broker: dict, generator: dict, generator_ids: list[str], producer_ids: list[str]
) -> dict[str, str]:
    """The run's ingest keys that the configs use (the module's docstring); returns generator id -> the
    certificate relay up gives it (empty when ``generator.ingest_key_file`` names one for all, or without
    CURVE)."""
    from broker.protocol.ingest_auth import IngestAuthError

    if broker.get("ingest_auth", "curve") != "curve":
        return {}
    d = ingest_key_dir(run_dir)
    clients_file = d / "clients.json"
    ours = {
        "broker": broker.get("ingest_key_file") == str(d / "broker.key_secret")
        or generator.get("broker_public_key_file") == str(d / "broker.key"),
        "clients": broker.get("ingest_clients_file") == str(clients_file),
        "generators": not generator.get("ingest_key_file"),
    }
    if producer_ids and not ours["clients"]:
        raise IngestAuthError(_own_list_note(broker.get("ingest_clients_file")))
    if not any(ours.values()):
        return {}  # every key is the user's own: none of the run's is written
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    os.chmod(d.parent, 0o700)
    if ours["broker"]:
        _certificate(d, "broker")
    out = {}
    clients = []
    if ours["generators"]:
        for gid in generator_ids:
            clients.append(
                {
                    "public_key": _certificate(d, f"generator-{gid}"),
                    "generator_id": "".join(f"[{c}]" if c in "*?[" else c for c in gid),
                }
            )
            out[gid] = str(d / f"generator-{gid}.key_secret")
    for pid in producer_ids:  # bound to exactly its id: "producer-<i>" holds no pattern character
        clients.append({"public_key": _certificate(d, pid), "generator_id": pid})
    if ours["clients"] and not clients_file.exists():  # kept by a resume
        clients_file.write_text(json.dumps({"clients": clients}, indent=1))
    for f in d.iterdir():
        os.chmod(f, 0o600)
    return out


def check_ingest_keys(
    run_dir: Path, broker: dict, generator: dict, generator_ids: list[str], producer_ids: list[str] = ()
) -> None:
    """Before anything starts: the keys the configs name fit together, the broker's certificate, its
    allow-list, each generator's certificate (admitted for its id) and copy of the broker's public key. A
    mismatch would otherwise show only as groups that never get an answer (a refused handshake is silent
    to the producer, docs/protocol.md 5.4) or are rejected ``wrong_generator``. The run's own files (in
    ``secrets/ingest/``) fit together by construction; the user's own are read."""
    from broker.protocol.ingest_auth import IngestAuthError, load_allow_list, load_server_keys

    if broker.get("ingest_auth", "curve") != "curve":
        return
    d = ingest_key_dir(run_dir)
    fields = {
        "broker.ingest_key_file": broker.get("ingest_key_file", ""),
        "broker.ingest_clients_file": broker.get("ingest_clients_file", ""),
        "generator.broker_public_key_file": generator.get("broker_public_key_file", ""),
        "generator.ingest_key_file": generator.get("ingest_key_file", ""),
    }
    # None: the run's own (made by relay up, in secrets/ingest/; the generators' keys are when unset)
    real = {f: v if v and Path(v).parent != d else None for f, v in fields.items()}
    hint = "(docs/protocol.md section 12, 'Your own keys'): set both, or leave both to relay up"
    server, copy = real["broker.ingest_key_file"], real["generator.broker_public_key_file"]
    copy_field = "generator.broker_public_key_file"
    if (server is None) != (copy is None):
        raise IngestAuthError(
            f"broker.ingest_key_file and generator.broker_public_key_file must be one key pair, but "
            f"only {'broker.ingest_key_file' if server else 'generator.broker_public_key_file'} is "
            f"your own {hint}"
        )
    if server is not None:
        server_public, _ = load_server_keys(server, "broker.ingest_key_file")
        if _public_of(copy, copy_field) != server_public.decode():
            raise IngestAuthError(
                f"generator.broker_public_key_file = {copy!r} is not the public key of "
                f"broker.ingest_key_file = {server!r}: the generators could never complete the "
                f"handshake {hint}"
            )
    clients, gen_key = real["broker.ingest_clients_file"], real["generator.ingest_key_file"]
    if (clients is None) != (gen_key is None):
        raise IngestAuthError(
            f"broker.ingest_clients_file and generator.ingest_key_file go together: the run's "
            f"allow-list admits only the run's generator keys, and your own allow-list does not "
            f"hold them; only {'broker.ingest_clients_file' if clients else 'generator.ingest_key_file'} "
            f"is your own {hint}"
        )
    if clients is not None and producer_ids:
        raise IngestAuthError(_own_list_note(clients))
    if clients is not None:
        allow = load_allow_list(clients, "broker.ingest_clients_file")
        pattern = allow.patterns.get(_public_of(gen_key))
        for gid in generator_ids:
            if pattern is None or not fnmatch.fnmatchcase(gid, pattern):
                raise IngestAuthError(
                    f"generator.ingest_key_file = {gen_key!r} is not admitted for generator id "
                    f"{gid!r} by broker.ingest_clients_file = {clients!r}"
                    + (f" (it binds that key to {pattern!r})" if pattern else "")
                    + ": bind it to the pattern gen-* there"
                )


def _own_list_note(clients: str) -> str:
    return (
        f"--producers adds each producer's key to the run's allow-list, but broker.ingest_clients_file = "
        f"{clients!r} is your own: add your producers' keys to it instead (docs/protocol.md section 12, "
        f"'Your own keys')"
    )


def _public_of(certificate: str, field: str = "generator.ingest_key_file") -> str:
    import zmq.auth

    from broker.protocol.ingest_auth import IngestAuthError

    try:
        public, _ = zmq.auth.load_certificate(certificate)
    except (OSError, ValueError) as e:
        raise IngestAuthError(f"{field} = {certificate!r} is not a readable ZeroMQ certificate ({e})") from None
    return public.decode()
