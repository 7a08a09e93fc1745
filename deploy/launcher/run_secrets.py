"""A run's secrets, written by ``relay up`` into ``runs/<id>/secrets/`` (mode 0700, files 0600) and
read back by ``relay up --resume``:

    secrets/announce.key          the private announcement key (Ed25519, PEM): the learner's alone, it signs
    secrets/announce.pub          its public half: the broker, the generators and the launcher verify
    secrets/weights.key           the weights key: the learner's weight listeners admit its holders (the
                                  learner and the generators; http transport's token, collective joins)
    secrets/redis/<user>.password one password per Redis user (broker, learner, generator, launcher, and
                                  producer-<i> for each producer of ``relay up --producers N``)
    secrets/redis/users.acl       the embedded redis-server's ACL file (``--aclfile``): those users,
                                  passwords as SHA-256, no way to log in as ``default``

Each Redis user may run only the commands its service needs, on the run's keys its service reads or
writes (deploy/launcher/redis_acl.py: only the broker writes the trajectories stream, only the learner
the announcements), and no command of the ``@dangerous`` category; the launcher, which only watches
the run, may only read. The services get
their user's credentials in their Redis URL (``redis://learner:<password>@127.0.0.1:<port>/0``),
through the environment (deploy/launcher/environment.py ``SECRETS``), never a config file.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from broker.protocol import weightauth
from broker.protocol.signing import read_signer, write_key_pair
from deploy.launcher.redis_acl import PRODUCER_PREFIX, acl_permissions

SERVICE_USERS = ("broker", "learner", "generator")
LAUNCHER_USER = "launcher"
USERS = (*SERVICE_USERS, LAUNCHER_USER)


def secrets_dir(run_dir: Path) -> Path:
    return run_dir / "secrets"


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _write_private(path: Path, text: str) -> None:
    """``text`` into ``path`` with mode 0600 from its creation (replacing the file if it exists)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def announce_key_path(run_dir: Path) -> Path:
    return secrets_dir(run_dir) / "announce.key"


def announce_public_key_path(run_dir: Path) -> Path:
    return secrets_dir(run_dir) / "announce.pub"


def weights_key_path(run_dir: Path) -> Path:
    return secrets_dir(run_dir) / "weights.key"


def write_run_keys(run_dir: Path) -> None:
    """The run's announcement key pair and weights key (kept when they exist: a resumed run signs with the
    same key; a key pair from before Ed25519 is refused, broker/protocol/signing.py)."""
    _private_dir(secrets_dir(run_dir))
    write_key_pair(announce_key_path(run_dir), announce_public_key_path(run_dir))
    weightauth.write_key_file(weights_key_path(run_dir))


def run_key_fields(run_dir: Path) -> dict[str, dict]:
    """Service -> the config fields that name its keys: the private announcement key for the learner only,
    the public one for the broker and the generators, the weights key for the learner and the generators."""
    public = str(announce_public_key_path(run_dir))
    weights = {"weights": {"key_file": str(weights_key_path(run_dir))}}
    return {
        "learner": {"announce_key_file": str(announce_key_path(run_dir)), **weights},
        "broker": {"announce_public_key_file": public},
        "generator": {"announce_public_key_file": public, **weights},
    }


def pin_weight_port(learner: dict, generator: dict, free_port) -> None:
    """``weights.transport = "http"``: a generator fetches only from the weight server its config names
    (``weights.transport.advertise_url``, or ``host`` and a fixed ``port``), so a learner left to pick any free
    port (0) gets a fixed one now, in both configs."""
    http = learner.setdefault("weights", {}).setdefault("transport", {"type": "http"})
    if http.get("advertise_url") or http.get("port"):
        return
    http["port"] = free_port()
    generator.setdefault("weights", {}).setdefault("transport", {"type": "http"}).setdefault("port", http["port"])


def made_before_ed25519(run_dir: Path) -> bool:
    """A run whose announcement key is the HMAC key every service held (a run from before Ed25519)."""
    from broker.protocol.signing import AnnounceKeyError

    path = announce_key_path(run_dir)
    if not path.is_file():
        return False
    try:
        read_signer(path)
    except AnnounceKeyError as e:
        return "HMAC" in str(e)
    return False


def acl_rules(run_id: str, user: str, password: str) -> str:
    """One line of the ACL file: ``user`` with ``password`` (stored as its SHA-256) and its rights on the
    run's keys (deploy/launcher/redis_acl.py)."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    return f"user {user} on #{digest} {acl_permissions(run_id, user)}"


def run_redis_url(run_dir: Path, user: str = LAUNCHER_USER) -> str:
    """The URL of a run's Redis with ``user``'s credentials, for a tool (or a test) that watches the run:
    the recorded URL (``config/broker.json``, password redacted) with the password of ``secrets/redis/``.
    A run with an external Redis (or from before Redis had users) gives the recorded URL as it is."""
    import json

    recorded = json.loads((run_dir / "config" / "broker.json").read_text())
    users = RedisUsers.read(run_dir, recorded["run_id"])
    if users is None:
        return recorded["redis_url"]
    port = int(recorded["redis_url"].rsplit(":", 1)[1].split("/")[0])
    return users.url(user, port)


class RedisUsers:
    """The embedded Redis's users and their passwords, for one run."""

    def __init__(self, run_id: str, passwords: dict[str, str]):
        self.run_id, self.passwords = run_id, passwords

    @classmethod
    def new(cls, run_id: str, producers: list[str] | tuple[str, ...] = ()) -> "RedisUsers":
        """Every service's user, and one per producer id (``producer-<i>``: a generator's rights)."""
        return cls(run_id, {u: secrets.token_urlsafe(32) for u in (*USERS, *producers)})

    @classmethod
    def read(cls, run_dir: Path, run_id: str) -> "RedisUsers | None":
        """The users a run recorded (None for a run started before Redis had users)."""
        return cls.read_from(secrets_dir(run_dir), run_id)

    @classmethod
    def read_from(cls, secrets_folder: Path, run_id: str) -> "RedisUsers | None":
        """The users recorded in ``secrets_folder/redis`` (None when there are none)."""
        folder = secrets_folder / "redis"
        if not folder.is_dir():
            return None
        names = [*USERS, *sorted(f.name.removesuffix(".password") for f in folder.glob(f"{PRODUCER_PREFIX}*.password"))]
        return cls(run_id, {u: (folder / f"{u}.password").read_text().strip() for u in names})

    def producers(self) -> list[str]:
        """The producers' users (``relay up --producers N``), in id order."""
        return sorted((u for u in self.passwords if u.startswith(PRODUCER_PREFIX)), key=lambda u: int(u.split("-")[-1]))

    def url(self, user: str, port: int) -> str:
        return f"redis://{user}:{self.passwords[user]}@127.0.0.1:{port}/0"

    def acl_text(self) -> str:
        # `default` with no password at all (resetpass: not even nopass) cannot be logged in as, so a client
        # without credentials gets NOAUTH for everything. It keeps its rights because Redis (before 8.x)
        # replays the append-only file's MULTI/EXEC blocks as `default` and re-checks them against its ACL:
        # `default off` or `-@all` silently drops those transactions when a run is resumed (redis/redis#14541)
        lines = ["user default on resetpass ~* &* +@all"]
        lines += [acl_rules(self.run_id, u, self.passwords[u]) for u in self.passwords]
        return "\n".join(lines) + "\n"

    def write(self, run_dir: Path) -> Path:
        """The passwords and the ACL file into ``secrets/redis/``; returns the ACL file's path."""
        return self.write_to(secrets_dir(run_dir))

    def write_to(self, secrets_folder: Path) -> Path:
        """The passwords and the ACL file into ``secrets_folder/redis/``; returns the ACL file's path."""
        folder = _private_dir(_private_dir(secrets_folder) / "redis")
        for u, password in self.passwords.items():
            _write_private(folder / f"{u}.password", password + "\n")
        acl = folder / "users.acl"
        _write_private(acl, self.acl_text())
        return acl
