"""How a version reaches a generator: the receiving end of ``weights.transport``, built here and nowhere else
from the ``receiver`` its config class names (broker/protocol/weights_config.py; the learner's side:
learner/transports.py, with the table of both ends).

Every generator follows the signed announcements and can load any version from the weight store
(generators/weights.py ``WeightApplier``: the first load, restarts, and the fallback of every transport).
A transport adds one of two things, a :class:`Receiving` says which:

- ``fetcher`` (``http``, generators/weight_fetch.py): the version's files fetched from the learner's weight
  server into a local cache before they are verified and loaded, for generators with no shared volume;
- ``tensors`` (``collective``, generators/weight_receive.py; ``ipc``, generators/ipc_receive.py): a thread
  that receives each version's tensors in process, applied without touching the disk; only for a backend
  that can take tensors (``update_weights_from_tensors``), the others follow the store copy.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker.protocol.keys import Keys
    from broker.protocol.signing import AnnounceVerifier
    from generators.config import GeneratorConfig

log = logging.getLogger("relay.generator")


@dataclass(frozen=True)
class ReceiverContext:
    """What a receiving end may use: the generator's config, Redis connection and keys, its engine backend,
    the announcements' verifier and the weights key (http and collective; None otherwise)."""

    cfg: GeneratorConfig
    r: object
    keys: Keys
    backend: object
    announce_key: AnnounceVerifier | None
    weights_key: bytes | None


@dataclass(frozen=True)
class Receiving:
    """The receiving end of one transport, handed to the ``WeightApplier``: both None for ``store``."""

    fetcher: object | None = None  # fetch_kept(announcement, serving, keep) -> (path, version); digests
    tensors: object | None = None  # start(), next version's tensors, close(): generators/weight_receive.py Staging


def build_receiving(ctx: ReceiverContext) -> Receiving:
    """The receiving end ``ctx.cfg.weights.transport`` names (its config class's ``receiver``,
    "module:function" building a Receiving from a ReceiverContext; None: the store alone): the one place a
    generator chooses its transport."""
    transport = ctx.cfg.weights.transport
    if transport.receiver is None:
        return Receiving()
    if transport.in_process and not hasattr(ctx.backend, "update_weights_from_tensors"):
        log.warning(
            "weights.transport = %s: the %s backend cannot apply tensors in process; this generator "
            "loads each version from the store copy instead",
            transport.type,
            ctx.backend.name,
        )
        return Receiving()
    module, name = transport.receiver.split(":")
    return getattr(importlib.import_module(module), name)(ctx)
