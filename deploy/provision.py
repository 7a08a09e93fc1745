"""``relay secrets``: the secrets of a Docker Compose or Kubernetes deployment, made in one place.

    relay secrets deploy/secrets                          # the files docker-compose.yml mounts
    relay secrets deploy/secrets --k8s relay-secrets.yaml # and the same as Kubernetes Secrets
    kubectl apply -f relay-secrets.yaml                   # (namespace relay; --namespace to change)

``relay up`` makes a run's secrets itself (deploy/launcher/run_secrets.py, broker/protocol/ingest_auth.py);
this command makes the same kinds of secret for services started by Compose or Kubernetes, where the
run id is fixed by the deployment (``--run-id``: ``compose`` for docker-compose.yml, ``k8s`` for the
manifests). The folder (mode 0700) gets:

    announce.key               the private announcement key (Ed25519, PEM): the learner's alone, it signs
    announce.pub               its public half: the broker and the generators check announcements with it
    weights.key                the weights key: the learner's weight server (http transport) admits its
                               holders, the learner and the generators
    ingest/broker.key_secret   the broker's CURVE certificate (ingest), ingest/broker.key its public half
    ingest/generator-generator.key_secret  the generators' certificate: every replica shares it, bound to
                               the ids ``gen-*`` (the generators' default ids) in ingest/clients.json
    redis/users.acl            the Redis server's ACL file (one user per service, run's keys only)
    redis/<user>.password      each user's password (launcher: the read-only user of health checks)
    broker.env, learner.env, generator.episodes.env   RELAY_REDIS_URL with that service's user and password
    relay.env                  the reward service's bearer token (RELAY_AUTH_TOKEN, RELAY_REWARD_TOKEN)

Existing files are kept, so running it again changes nothing (``--force`` makes new ones), but for the
Redis ACL file, written again from the current rights of each user with the passwords it holds. An
announcement key from before Ed25519 (an HMAC key) is refused: ``--force`` makes a new pair. Containers
run as another user than the one who runs this (uid 10001 for Relay, 999 for Redis) and Compose
bind-mounts secret files as they are, so the files are readable (0644) while the folder (0700) keeps
every other user of the host out. Kubernetes Secrets are mounted with the modes the manifests set.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import sys
from pathlib import Path

from broker.protocol.ingest_auth import write_ingest_keys
from broker.protocol import weightauth
from broker.protocol.signing import write_key_pair
from deploy.launcher.run_secrets import SERVICE_USERS, RedisUsers

GENERATOR_KEY = "generator"  # one certificate for every generator replica
GENERATOR_IDS = "gen-*"  # the ids it may send as: the generators' default ids (gen-<host>-<pid>)
REDIS_HOST = "redis:6379"


def make(folder: Path, run_id: str, redis_host: str = REDIS_HOST, force: bool = False) -> dict[str, Path]:
    """Write the deployment's secrets into ``folder`` (kept where they exist unless ``force``);
    returns what each file is -> its path."""
    if force and folder.exists():
        for sub in ("ingest", "redis"):
            shutil.rmtree(folder / sub, ignore_errors=True)
        for name in ("announce.key", "announce.pub", "weights.key", "relay.env", *(f"{u}.env" for u in SERVICE_USERS)):
            (folder / name).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    private, public = write_key_pair(folder / "announce.key", folder / "announce.pub")
    out = {
        "announce_key": private,
        "announce_public_key": public,
        "weights_key": weightauth.write_key_file(folder / "weights.key"),
    }
    if not (folder / "ingest" / "clients.json").exists():
        write_ingest_keys(folder / "ingest", [GENERATOR_KEY], patterns={GENERATOR_KEY: GENERATOR_IDS})
    out.update(
        ingest_broker_secret=folder / "ingest" / "broker.key_secret",
        ingest_broker_public=folder / "ingest" / "broker.key",
        ingest_clients=folder / "ingest" / "clients.json",
        ingest_generator_secret=folder / "ingest" / f"generator-{GENERATOR_KEY}.key_secret",
    )
    users = RedisUsers.read_from(folder, run_id) if (folder / "redis" / "users.acl").exists() else None
    users = users or RedisUsers.new(run_id)
    users.write_to(folder)  # the ACL file always from the current rights (deploy/launcher/redis_acl.py), passwords kept
    out.update(redis_acl=folder / "redis" / "users.acl", redis_launcher_password=folder / "redis" / "launcher.password")
    for user in SERVICE_USERS:
        env = folder / f"{user}.env"
        if not env.exists():
            env.write_text(f"RELAY_REDIS_URL=redis://{user}:{users.passwords[user]}@{redis_host}/0\n")
        out[f"{user}_env"] = env
    token = folder / "relay.env"
    if not token.exists():
        t = secrets.token_urlsafe(32)
        token.write_text(f"RELAY_AUTH_TOKEN={t}\nRELAY_REWARD_TOKEN={t}\n")
    out["reward_env"] = token
    for path in [p for p in folder.rglob("*")]:
        os.chmod(path, 0o700 if path.is_dir() else 0o644)  # readable by the containers' users; see above
    os.chmod(folder, 0o700)
    return out


def _env_value(path: Path, name: str) -> str:
    for line in path.read_text().splitlines():
        if line.startswith(f"{name}="):
            return line.split("=", 1)[1]
    raise KeyError(f"{name} not in {path}")


def k8s_secrets(files: dict[str, Path], namespace: str) -> str:
    """The Kubernetes Secrets the manifests in deploy/k8s/base mount or read, as one YAML stream."""

    def secret(name: str, data: dict[str, bytes]) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "relay"}},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }

    read = {
        k: p.read_bytes()
        for k, p in files.items()
        if k not in ("broker_env", "learner_env", "generator_env", "reward_env")
    }
    docs = [
        secret("relay-announce-key", {"key": read["announce_key"]}),  # the learner's alone
        secret("relay-announce-public", {"key": read["announce_public_key"]}),  # the broker's, the generators'
        secret("relay-weights-key", {"key": read["weights_key"]}),  # the learner's and the generators'
        secret(
            "relay-ingest-broker",
            {"broker.key_secret": read["ingest_broker_secret"], "clients.json": read["ingest_clients"]},
        ),
        secret(
            "relay-ingest-generator",
            {"generator.key_secret": read["ingest_generator_secret"], "broker.key": read["ingest_broker_public"]},
        ),
        secret(
            "relay-redis-acl", {"users.acl": read["redis_acl"], "launcher.password": read["redis_launcher_password"]}
        ),
        secret("relay-reward-token", {"token": _env_value(files["reward_env"], "RELAY_AUTH_TOKEN").encode()}),
    ]
    for user in SERVICE_USERS:
        docs.append(
            secret(f"relay-redis-{user}", {"url": _env_value(files[f"{user}_env"], "RELAY_REDIS_URL").encode()})
        )
    return "".join("---\n" + json.dumps(d, indent=1) + "\n" for d in docs)  # JSON is YAML


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="where the secret files go (docker-compose.yml reads deploy/secrets)")
    p.add_argument("--run-id", default=None, help="the deployment's run id (default: compose, or k8s with --k8s)")
    p.add_argument("--redis-host", default=REDIS_HOST, help=f"host:port of Redis in the services' URLs ({REDIS_HOST})")
    p.add_argument("--k8s", metavar="FILE", help="also write the Kubernetes Secrets to FILE (kubectl apply -f FILE)")
    p.add_argument("--namespace", default="relay", help="the Secrets' namespace (relay)")
    p.add_argument("--force", action="store_true", help="make new secrets even where files exist")


def run(args) -> int:
    run_id = args.run_id or ("k8s" if args.k8s else "compose")
    files = make(Path(args.folder), run_id, args.redis_host, args.force)
    print(f"relay secrets: {len(files)} secrets for run id {run_id!r} in {args.folder} (folder 0700)")
    if args.k8s:
        out = Path(args.k8s)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(k8s_secrets(files, args.namespace))
        print(f"relay secrets: Kubernetes Secrets in {out} (mode 0600): kubectl apply -f {out}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
