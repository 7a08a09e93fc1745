"""Publishing versions: an immutable snapshot in the weight store, then the announcement."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from broker.client.announcements import advertise_run, announce
from broker.client.telemetry import emit_event, read_heartbeats
from broker.protocol import weightstore
from broker.protocol.keys import Keys
from broker.protocol.messages import Announcement

log = logging.getLogger("relay.learner.publish")


class NonFiniteWeights(ValueError):
    """Weights with a NaN or ±inf: never published (generators would serve garbage or crash)."""


def nonfinite_tensors(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors of ``state_dict`` that hold a NaN or ±inf."""
    return [k for k, v in state_dict.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def first_version(latest_announced: int | None, store: str | Path) -> int:
    """The version a (re)starting learner publishes first: one past both the latest announcement and
    the newest snapshot in the store. A learner killed between sealing a snapshot (the rename) and
    announcing it leaves that version's folder behind unannounced; versions are immutable, so its
    number is skipped rather than written again."""
    stored = weightstore.list_versions(store)
    return max(latest_announced + 1 if latest_announced is not None else 0, stored[-1] + 1 if stored else 0)


class Publisher:
    def __init__(self, r, keys: Keys, store: str, tokenizer, keep_versions: int, announce_key: bytes | None = None,
                 broadcaster=None):
        self.r, self.keys, self.tokenizer = r, keys, tokenizer
        self.broadcaster = broadcaster  # the collective transport (learner/broadcast.py): broadcast before the store copy
        self.announce_key = announce_key  # signs each announcement (None: unsigned, announce_auth insecure)
        self.store = Path(store).resolve()
        self.store.mkdir(parents=True, exist_ok=True)
        self.keep_versions = keep_versions
        self.heartbeat_ttl_s = 60.0

    def publish(self, model, state_dict: dict[str, torch.Tensor], version: int) -> Announcement:
        """Seal and announce ``state_dict`` as ``version``; NonFiniteWeights (nothing written) when a
        weight is not finite."""
        t0 = time.perf_counter()
        bad = nonfinite_tensors(state_dict)
        if bad:
            raise NonFiniteWeights(f"version {version} not published: {len(bad)} weight(s) hold NaN or inf "
                                   f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
        staging = weightstore.staging_dir(self.store, version)
        state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state_dict.items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        tensors = self.broadcaster.send(version, state) if self.broadcaster is not None else ""
        model.config.save_pretrained(staging)
        self.tokenizer.save_pretrained(staging)
        from safetensors.torch import save_file

        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt", "version": str(version)})
        path, digest = weightstore.seal(self.store, version, staging)
        a = Announcement(version=version, hash=digest, path=str(path), digest=tensors)
        announce(self.r, self.keys, a, self.announce_key)
        advertise_run(self.r, self.keys, eos_token_id=self.tokenizer.eos_token_id)  # the run's EOS (protocol 7.11)
        emit_event(self.r, self.keys, "published", version=version, hash=digest)
        # versions served by generators seen recently (a dead generator's heartbeat does not pin)
        now = time.time()
        in_use = {hb.version for hb in read_heartbeats(self.r, self.keys).values()
                  if hb.last_seen is not None and now - hb.last_seen < self.heartbeat_ttl_s}
        weightstore.prune(self.store, self.keep_versions, {v for v in in_use if v is not None})
        log.debug("published version %d in %.3fs", version, time.perf_counter() - t0)
        return a
