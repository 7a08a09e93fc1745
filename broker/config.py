"""The broker's config (no torch import)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from broker.client.connection import connect_address, worker_addresses
from broker.prompts.datasets import DatasetConfig
from broker.protocol.keys import EVENTS_MAX, RECORD_WINDOW
from broker.prompts.evals import EvalConfig
from broker.prompts.tasks import TaskConfig
from broker.runtime.binds import ALLOW_DESCRIPTION, refuse_open_bind, zmq_bind_host
from broker.runtime.config import StrictModel, VerifyingConnection  # noqa: F401 (StrictModel: for plugins, docs/rewards.md)


class BrokerConfig(VerifyingConnection):
    """The broker: where it listens, how much it queues, which prompts it feeds."""

    ingest_bind: str = Field("tcp://127.0.0.1:5555", description="ZeroMQ ROUTER address generators send groups to")
    ingest_advertise: str = Field(
        "",
        description="the address producers are told to connect to (the run's "
        "advertisement in Redis, docs/protocol.md 7.11); '' = ingest_bind, a wildcard host "
        "(*, 0.0.0.0, ::) replaced by this host's name",
    )
    ingest_workers: int = Field(
        1,
        ge=1,
        le=64,
        description="ingest processes, each validating and appending on a "
        "socket of its own: worker k binds ingest_bind's port + k; producers connect to "
        "them all and spread their groups (docs/protocol.md 5.1)",
    )
    ingest_auth: Literal["curve", "insecure"] = Field(
        "curve",
        description="who may send groups: 'curve' = only producers whose CURVE public key is in "
        "ingest_clients_file, each bound to the generator ids it may use; 'insecure' = anyone who reaches "
        "ingest_bind (shown on the dashboard; docs/security.md)",
    )
    ingest_key_file: str = Field(
        "",
        description="the broker's CURVE certificate (the .key_secret file "
        "zmq.auth.create_certificates writes; relay up makes one per run)",
    )
    ingest_clients_file: str = Field(
        "",
        description='the allow-list: JSON {"clients": [{"public_key": "<z85>", "generator_id": "<fnmatch pattern>"}]}',
    )
    allow_unauthenticated_bind: bool = Field(
        False, description=ALLOW_DESCRIPTION + ": here, ingest_auth = 'insecure' on an ingest_bind that is not loopback"
    )
    http_host: str = Field("127.0.0.1", description="host of the HTTP server (health, metrics, state)")
    http_port: int = Field(8080, ge=0, le=65535, description="port of the HTTP server; 0 picks a free one")
    dead_after_s: float = Field(
        10.0, gt=0, description="the dashboard shows a generator as dead when its last heartbeat is older than this"
    )
    dashboard_push_s: float = Field(1.0, gt=0, le=60, description="seconds between the dashboard's live updates")
    max_queue_groups: int = Field(256, ge=1, description="trajectories stream bound; above it producers get 'busy'")
    max_queue_bytes: int = Field(
        256 << 20,
        ge=1 << 20,
        description="trajectories stream bound in bytes (the "
        "group messages held, read or not); above it producers get 'busy'",
    )
    max_message_bytes: int = Field(
        16 << 20,
        ge=1024,
        description="largest accepted group message; one up to a "
        "sixteenth larger (at least 64 KiB) is answered too_large, a larger ZeroMQ frame "
        "closes the producer's connection unanswered (docs/protocol.md 5.1)",
    )
    dead_letter_max: int = Field(1000, ge=0, description="rejected messages kept for inspection")
    record_window: int = Field(
        RECORD_WINDOW,
        ge=0,
        description="group ids remembered for de-duplication: the "
        "last record_window to 2x as many (a resend of an older group is taken as new); "
        "0 keeps every id of the run (Redis memory grows with the run)",
    )
    events_kept: int = Field(
        EVENTS_MAX,
        ge=100,
        le=EVENTS_MAX,
        description="entries kept in the events stream "
        "(the dashboard's event log): the broker trims it to about this many every second",
    )
    prompt_backlog: int = Field(64, ge=1, description="prompts kept ready in the prompts stream")
    task: TaskConfig = Field(
        default_factory=TaskConfig, description="the built-in task that feeds prompts (when no dataset is given)"
    )
    dataset: DatasetConfig | None = Field(
        None, description="a prompt dataset of your own (docs/datasets.md); null = the built-in task"
    )
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="evaluation on a held-out set every N versions (docs/eval.md)"
    )

    def advertised_ingest(self) -> str:
        """The address producers are told to connect to (``RunInfo.ingest_address``: the first worker's)."""
        return self.ingest_advertise or connect_address(self.ingest_bind)

    def advertised_ingests(self) -> list[str]:
        """Every ingest worker's address, as producers connect to them (``RunInfo.ingest_addresses``)."""
        return worker_addresses(self.advertised_ingest(), self.ingest_workers)

    def ingest_binds(self) -> list[str]:
        """The address each ingest worker binds (worker k at ingest_bind's port + k)."""
        return worker_addresses(self.ingest_bind, self.ingest_workers)

    @model_validator(mode="after")
    def _worker_ports(self) -> "BrokerConfig":
        try:
            self.ingest_binds()
            self.advertised_ingests()
        except ValueError as e:
            raise ValueError(f"ingest_workers = {self.ingest_workers}: {e}") from None
        return self

    @model_validator(mode="after")
    def _no_open_ingest_without_auth(self) -> "BrokerConfig":
        if self.ingest_auth == "insecure":
            refuse_open_bind(
                "ingest_bind",
                self.ingest_bind,
                zmq_bind_host(self.ingest_bind),
                "ingest_auth = 'insecure' lets anyone who reaches it send groups the learner trains on",
                "use ingest_auth = 'curve' with its key files",
                self.allow_unauthenticated_bind,
            )
        return self

    @model_validator(mode="after")
    def _held_out_set(self) -> "BrokerConfig":
        if (
            self.dataset is not None
            and self.eval.every_versions
            and self.eval.dataset is None
            and not self.dataset.start
        ):
            raise ValueError(
                "eval: evaluation needs a held-out set: set eval.dataset, or dataset.start to leave the "
                "first rows out of training, or eval.every_versions = 0"
            )
        return self
