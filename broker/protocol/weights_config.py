"""The ``[weights]`` section: how versions travel from the learner to the generators, one config for both.

``relay up`` gives the run's ``[weights]`` to the learner and to every generator; a service on its own takes
it as ``weights.*``. The transport is one section chosen by its ``type`` (a discriminated union, as the
generator backends are), and each transport's config class names both of its ends:

    [weights.transport]          # or, with the transport's defaults: weights.transport = "http"
    type = "http"                # store | http | collective | ipc
    port = 8200

- ``store``: :class:`StoreTransport`; learner/transports.py ``Sender``; the generators load from the store;
- ``http``: :class:`HttpTransport`; learner/weight_server.py ``HttpSender``; generators/weight_fetch.py;
- ``collective``: :class:`CollectiveTransport`; learner/broadcast.py ``CollectiveSender``;
  generators/weight_receive.py;
- ``ipc``: :class:`IpcTransport`; learner/ipc.py ``IpcSender``; generators/ipc_receive.py.

learner/transports.py ``build_sender`` and generators/transports.py ``build_receiving`` build the two ends
from the config's class; nothing else reads the type. A plain string (``--set weights.transport=http``) is
the short spelling of that type with its defaults, no warning. Older configs kept a transport's settings in
``[weights.http]`` or ``[weights.collective]``: those are moved into ``weights.transport`` when its type is
theirs, and ignored otherwise, with one warning (docs/config.md, "Renamed keys").

This module imports no torch.
"""

from __future__ import annotations

import typing
from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field

from broker.runtime.config import StrictModel


class StoreTransport(StrictModel):
    """``type = "store"``: immutable version folders on a volume the learner and every generator share (the
    default; every other transport writes this copy too, for late joiners, restarts and the audit)."""

    type: Literal["store"] = "store"
    sender: ClassVar[str] = "learner.transports:Sender"  # "module:class" of the learner's end
    receiver: ClassVar[str | None] = None  # "module:function" of the generator's end; None: the store alone
    in_process: ClassVar[bool] = False  # versions handed to the generators' engines in process (module docstring)
    listens: ClassVar[bool] = False  # the learner opens a listener on host:port that the weights key guards


class HttpTransport(StrictModel):
    """``type = "http"``: the learner serves its weight store over HTTP; no shared volume (docs/weights.md)."""

    type: Literal["http"] = "http"
    sender: ClassVar[str] = "learner.weight_server:HttpSender"
    receiver: ClassVar[str | None] = "generators.weight_fetch:receiving"
    in_process: ClassVar[bool] = False
    listens: ClassVar[bool] = True

    host: str = Field("127.0.0.1", description="address the learner's weight server binds")
    port: int = Field(0, ge=0, le=65535, description="its port (0 = any free port; the URL is announced)")
    advertise_url: str = Field(
        "",
        description="base URL the generators fetch from (default: http://host:port; "
        "set it when the generators reach the learner under another name). A generator "
        "fetches only from this URL (or http://host:port with a fixed port), whatever URL an "
        "announcement names; relay up sets it",
    )
    cache_dir: str = Field(
        "", description="generators: folder the fetched versions are kept in (default: a private temporary folder)"
    )
    linger_s: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="learner: at the end of the run, keep serving until "
        "every live generator serves the last version, at most this long",
    )

    def base_url(self) -> str:
        """The learner's weight server as configured: ``advertise_url``, else ``http://host:port`` when the
        port is fixed; "" when the port is only chosen when the server starts (0)."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        if not self.port:
            return ""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"


class CollectiveTransport(StrictModel):
    """``type = "collective"``: each version broadcast over torch.distributed straight into the generators'
    engines, its store copy written behind (docs/weights.md)."""

    type: Literal["collective"] = "collective"
    sender: ClassVar[str] = "learner.broadcast:CollectiveSender"
    receiver: ClassVar[str | None] = "generators.weight_receive:receiving"
    in_process: ClassVar[bool] = True
    listens: ClassVar[bool] = True

    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="process-group backend: auto = nccl on GPUs, gloo on CPU"
    )
    host: str = Field(
        "127.0.0.1",
        description="address the learner's rendezvous binds (that address only); joins "
        "prove the run's weights key (weights.auth)",
    )
    port: int = Field(0, ge=0, le=65535, description="its port (0 = any free port; the address is advertised in Redis)")
    max_members: int = Field(
        256,
        ge=1,
        le=4096,
        description="generators the learner broadcasts to at most; a join "
        "beyond is refused (each member is a gloo group with its own threads)",
    )
    bucket_mb: float = Field(64.0, gt=0, description="tensors are broadcast in buckets of about this many MiB")
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="a broadcast (or a join) that takes longer drops the "
        "generator from the group; it catches up from the store and joins again",
    )


class IpcTransport(StrictModel):
    """``type = "ipc"``: generators on the learner's host copy each version from its shared memory (CUDA IPC
    on a GPU), its store copy written behind (docs/weights.md)."""

    type: Literal["ipc"] = "ipc"
    sender: ClassVar[str] = "learner.ipc:IpcSender"
    receiver: ClassVar[str | None] = "generators.ipc_receive:receiving"
    in_process: ClassVar[bool] = True
    listens: ClassVar[bool] = False


# every transport, chosen by ``weights.transport.type`` (adding one: its class here, one file per side)
TRANSPORT_CONFIGS = (StoreTransport, HttpTransport, CollectiveTransport, IpcTransport)
TransportConfig = Annotated[Union[TRANSPORT_CONFIGS], Field(discriminator="type")]
TRANSPORTS: dict[str, type[StrictModel]] = {c.model_fields["type"].default: c for c in TRANSPORT_CONFIGS}
# the transports that hand each version to the generators' engines in process (learner/broadcast.py,
# learner/ipc.py): whole models, received by a generator thread, with the store copy written behind
IN_PROCESS_TRANSPORTS = tuple(name for name, c in TRANSPORTS.items() if c.in_process)


class WeightsConfig(StrictModel):
    """How versions travel from the learner to the generators: one section that ``relay up`` gives to both
    (``--set weights.transport=http``); a service on its own takes it as ``weights.*`` (docs/weights.md)."""

    # the transports' sections before they became ``transport`` (moved there when its type is theirs)
    __renamed_by_type__: ClassVar[typing.Mapping[str, tuple[str, str]]] = {
        "http": ("transport", "http"),
        "collective": ("transport", "collective"),
    }

    transport: TransportConfig = Field(
        default_factory=StoreTransport,
        description="the transport, chosen by its type (a plain string is that type with its defaults: "
        'weights.transport = "http"): store: immutable folders on a shared volume; http: the learner serves '
        "them, no shared volume; collective: broadcast straight into the generators' engines (store copy written "
        "behind); ipc: generators on the learner's host copy each version from its shared memory (CUDA IPC on a "
        "GPU; store copy written behind)",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="dtype of the published weights: auto = the training dtype (bf16 when "
        "learner.deepspeed.bf16), else as given",
    )
    shard_mb: float = Field(
        512.0,
        gt=0,
        description="safetensors shard size in MiB (several shards: the Hugging "
        "Face index is written too; shards are what lets hash_threads hash one version on "
        "several cores)",
    )
    hash_threads: int = Field(
        8,
        ge=1,
        le=64,
        description="shards written and hashed side by side by the learner, "
        "and read and verified side by side by each generator (one file's sha256 is "
        "sequential: ~1.5 GB/s per core)",
    )
    digest: Literal["xxh3", "sha256"] = Field(
        "xxh3",
        description="per-tensor hash of the tensor digest every generator checks against what it applied: "
        "xxh3 (XXH3-128, ~5x faster) or sha256 (cryptographic; the files' own hashes are sha256 either way)",
    )
    auth: Literal["key", "insecure"] = Field(
        "key",
        description="key: the learner's weight listeners (the http server, the collective rendezvous) admit "
        "only holders of the run's weights key (key_file): the learner and the generators; insecure: whoever reaches "
        "the port receives the weights (docs/security.md)",
    )
    key_file: str = Field(
        "",
        description="file holding the run's weights key (64 hex digits, mode 0600; relay up "
        "writes runs/<id>/secrets/weights.key); read by the learner and the generators with the "
        "http and collective transports",
    )
