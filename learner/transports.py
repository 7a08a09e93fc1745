"""How a version leaves the learner: the sender of ``weights.transport``, built here and nowhere else.

Every version, whatever the transport, is written to the weight store and announced by the leader's
publisher (learner/publish.py): that copy is what late joiners, restarted generators and the audit read.
A transport adds to it what this module's :class:`Sender` names, one class in one file per transport. Which
class is the transport's config's to say: each config class in broker/protocol/weights_config.py names its
``sender`` here and its ``receiver`` on the generator side (generators/transports.py), so the pair is read in
one place:

| transport    | learner side (the sender)                          | generator side (generators/transports.py)   |
|--------------|----------------------------------------------------|---------------------------------------------|
| `store`      | :class:`Sender` (nothing more than the store copy) | generators/weights.py (loads from the store) |
| `http`       | learner/weight_server.py ``HttpSender``            | generators/weight_fetch.py                  |
| `collective` | learner/broadcast.py ``CollectiveSender``          | generators/weight_receive.py                |
| `ipc`        | learner/ipc.py ``IpcSender``                       | generators/ipc_receive.py                   |

The shared pieces both sides import live in broker/protocol/ (the transports' configs: weights_config.py;
the manifest and the store layout: weightstore.py; tensor digests: tensordigest.py; the wire layout of
in-process versions: collective.py and ipc.py; signed announcements: signing.py; the weights key:
weightauth.py). Adding a transport: a ``Sender`` subclass in one new learner file, a receiver in one new
generator file, and its config class (naming both) in broker/protocol/weights_config.py's union
(docs/weights.md, "Adding a transport").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from broker.protocol.keys import Keys
    from broker.protocol.signing import AnnounceSigner
    from learner.config import LearnerConfig
    from learner.publish import Publisher


@dataclass(frozen=True)
class SenderContext:
    """What a sender may use: the learner's config, its Redis connection and keys, the key that signs
    announcements, and the weights key (http and collective; None otherwise)."""

    cfg: LearnerConfig
    r: object
    keys: Keys
    announce_key: AnnounceSigner | None
    weights_key: bytes | None


class Sender:
    """The learner leader's side of a transport. This base class is the ``store`` transport: the
    generators read each version from the store, so it adds nothing. The learner calls, in order:

    - ``handoff``: set by an in-process transport, the object the publisher hands each version to before
      its store copy (``buffers`` for its snapshot, ``send`` to deliver it; learner/publish.py);
    - :meth:`attach` once the publisher exists (the http transport names its URLs in the announcements);
    - :meth:`stage` with each version's full weights, before the snapshot (the ipc transport copies them
      into a shared slot on the device at once);
    - :meth:`close` once the publisher is drained and closed (stop handing versions over);
    - :meth:`finish` when the run is over, before ``done`` is set (the http transport serves until the
      generators have the last version)."""

    name = "store"
    handoff = None

    def __init__(self, ctx: SenderContext):
        self.ctx = ctx

    def attach(self, publisher: Publisher) -> None:
        pass

    def stage(self, version: int, weights: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool) -> None:
        pass

    def close(self) -> None:
        pass

    def finish(self, version: int) -> None:
        pass


def build_sender(ctx: SenderContext) -> Sender:
    """The sender ``ctx.cfg.weights.transport`` names (its config class's ``sender``, "module:class"): the one
    place the learner chooses its transport. Imported only when chosen: the collective's torch.distributed, the
    ipc's shared memory and the http server load nothing for the others."""
    module, name = ctx.cfg.weights.transport.sender.split(":")
    return getattr(importlib.import_module(module), name)(ctx)
