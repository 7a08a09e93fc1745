"""What a generator is doing (:class:`Progress`, read by its heartbeats and its ``/metrics``) and the
heartbeat that reports it (docs/protocol.md's Heartbeat): its weights, its sink's back-pressure and
counters, its engine, and its episodes' counters when it runs an environment."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.protocol.messages import Heartbeat

log = logging.getLogger("relay.generator")

if TYPE_CHECKING:
    from generators.episodes import EpisodeStats
    from generators.sink import Sink
    from generators.weights import WeightApplier


@dataclass
class Progress:
    """A generator's state and the tokens it sampled (its loop and its OpenAI endpoint add to them)."""

    state: str = "starting"
    tokens: int = 0
    tokens_per_s: float = 0.0  # of the last batch
    batches: int = 0
    last_end: float | None = None  # time.monotonic() at the end of the last batch

    def add_tokens(self, n: int) -> None:
        self.tokens += n

    def batch_done(self, started: float, samples: int, tokens: int, versions: tuple[int | None, int | None]) -> None:
        """Count a batch sampled from ``started`` (time.monotonic()) to now, and log where its time went: the
        sampling, and the wait before it since the previous batch ended (admission closed, no prompts, the
        sink full). Where a generator's time goes shows in its log, one line a batch."""
        now = time.monotonic()
        took = max(now - started, 1e-9)
        waited = started - self.last_end if self.last_end is not None else None
        self.batches, self.last_end, self.tokens_per_s = self.batches + 1, now, tokens / took
        self.add_tokens(tokens)
        v0, v1 = versions
        log.info(
            "batch %d: %d samples, %d tokens in %.1f s (%.1f tokens/s), version %s%s; waited %s before it",
            self.batches,
            samples,
            tokens,
            took,
            tokens / took,
            v0,
            f" to {v1}" if v1 != v0 else "",
            f"{waited:.1f} s" if waited is not None else "- (the first)",
        )


def heartbeat_message(
    generator_id: str,
    in_flight: str,
    backend,
    weights: WeightApplier,
    sink: Sink,
    progress: Progress,
    metrics_port: int,
    episodes: EpisodeStats | None,
) -> Heartbeat:
    """The heartbeat of a generator now. ``episodes``: the training episodes' counters (turns, tool calls and
    failures by tool, env latency, template drift), given when it runs an environment."""
    w = weights
    return Heartbeat(
        id=generator_id,
        backend=backend.name,
        version=w.version,
        # a version applied via the collective: its announced hash as soon as it is announced
        hash=w.hash or (w.hash_for(w.version, wait_s=0) if w.receiver is not None and w.version is not None else ""),
        # back-pressure on the sink shows even while the engine is busy generating
        state=sink.state if sink.state in ("paused_backpressure", "paused_reward") else progress.state,
        sink_state=sink.state,
        in_flight=in_flight,
        engine=backend.engine_info() if w.version is not None and hasattr(backend, "engine_info") else {},
        tokens_per_s=round(progress.tokens_per_s, 1),
        refused=dict(list(w.refused.items())[-3:]),
        metrics_port=metrics_port,
        groups_sent=sink.groups_sent,
        groups_rejected=sink.groups_rejected,
        tokens=progress.tokens,
        updates=w.updates,
        refused_updates=w.refused_updates,
        forged_announcements=w.forged_announcements,
        **sink.scored.fields(),
        last_update_latency_s=w.last_update_latency_s,
        **({"episodes": episodes.snapshot()} if episodes is not None else {}),
    )
