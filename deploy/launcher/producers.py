"""Producers of the user's own (``relay up --producers N``, docs/protocol.md section 12): programs that
are not one of ``relay up``'s generators but join the run through the protocol alone.

Each producer ``producer-<i>`` gets what a generator has, of its own:

- a CURVE certificate in the run's allow-list, bound to exactly the id ``producer-<i>``
  (``secrets/ingest/producer-<i>.key_secret``, deploy/launcher/ingest_keys.py);
- a Redis user ``producer-<i>`` with the generator's rights (deploy/launcher/redis_acl.py) and its password
  (``secrets/redis/producer-<i>.password``; embedded Redis only);
- one file that says where all of it is, ``secrets/producers/producer-<i>.json`` (0600, the folder
  0700), written again at every start with the addresses of that start (a resumed run may listen on
  other ports):

      {"run_id", "generator_id", "ingest_auth", "ingest_addresses",
       "curve": {"broker_public_key", "public_key", "secret_key", "key_file", "broker_public_key_file"},
       "redis": {"url", "host", "port", "user", "password"},
       "announce_public_key_file", "weight_store", "weights_key_file", "reward_url", "reward_token_file"}

A run resumed with ``relay up --resume`` keeps its producers (their keys, users and passwords).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlsplit

from deploy.launcher.redis_acl import PRODUCER_PREFIX

DOC = "docs/protocol.md section 12"


def add_argument(p) -> None:
    p.add_argument(
        "--producers",
        type=int,
        default=None,
        metavar="N",
        help="admit N producers of your own besides the generators (ids producer-0 ...): each gets a "
        "CURVE key in the allow-list and a Redis user; where everything is: "
        "runs/<id>/secrets/producers/producer-<i>.json (docs/protocol.md section 12; default 0)",
    )


def producer_ids(n: int) -> list[str]:
    return [f"{PRODUCER_PREFIX}{i}" for i in range(n)]


def producers_dir(run_dir: Path) -> Path:
    return run_dir / "secrets" / "producers"


def _z85(path: Path, secret: bool) -> str:
    import zmq.auth

    public, secret_key = zmq.auth.load_certificate(str(path))
    return (secret_key if secret else public).decode()


def write_connection_files(
    run_dir: Path,
    run_id: str,
    ids: list[str],
    broker: dict,
    generator: dict,
    reward_url: str,
    redis_users,
    redis_url: str,
) -> list[Path]:
    """``secrets/producers/<id>.json`` for each producer id (the module's docstring); returns their paths."""
    from deploy.launcher.ingest_keys import ingest_key_dir
    from deploy.launcher.run_secrets import announce_public_key_path, weights_key_path

    if not ids:
        return []
    folder = producers_dir(run_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    keydir = ingest_key_dir(run_dir)
    curve = broker.get("ingest_auth", "curve") == "curve"
    at = urlsplit(redis_url)
    token = run_dir / "secrets" / "reward.token"
    paths = []
    for pid in ids:
        info = {
            "run_id": run_id,
            "generator_id": pid,
            "ingest_auth": "curve" if curve else "insecure",
            "ingest_addresses": [a for a in str(generator.get("broker_address", "")).split(",") if a],
        }
        if curve:
            key, server = keydir / f"{pid}.key_secret", Path(generator.get("broker_public_key_file", ""))
            info["curve"] = {
                "broker_public_key": _z85(server, secret=False),
                "public_key": _z85(key, secret=False),
                "secret_key": _z85(key, secret=True),
                "key_file": str(key),
                "broker_public_key_file": str(server),
            }
        if redis_users is not None:  # the embedded Redis: the producer's own user
            info["redis"] = {
                "url": redis_users.url(pid, at.port),
                "host": at.hostname,
                "port": at.port,
                "user": pid,
                "password": redis_users.passwords[pid],
            }
        else:  # a Redis of the user's (--redis-url): its credentials are the user's to give
            info["redis"] = {
                "url": at._replace(netloc=f"{at.hostname}:{at.port}").geturl(),
                "host": at.hostname,
                "port": at.port,
                "user": None,
                "password": None,
            }
        info["announce_public_key_file"] = (
            str(announce_public_key_path(run_dir)) if generator.get("announce_auth", "ed25519") == "ed25519" else ""
        )
        info["weight_store"] = generator.get("weight_store", "")
        info["weights_key_file"] = str(weights_key_path(run_dir))
        info["reward_url"] = reward_url
        info["reward_token_file"] = str(token) if token.is_file() else ""
        path = folder / f"{pid}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.unlink(missing_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(json.dumps(info, indent=1) + "\n")
        tmp.replace(path)
        paths.append(path)
    return paths


def note(run_dir: Path, ids: list[str]) -> str:
    """The console line that says where the producers' files are."""
    return (
        f"{len(ids)} producer{'s' if len(ids) != 1 else ''} of your own may join as {', '.join(ids)}: keys, "
        f"Redis user and addresses in {producers_dir(run_dir)}/<id>.json ({DOC})"
    )
