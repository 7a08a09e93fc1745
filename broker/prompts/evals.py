"""Evaluation during training: a held-out prompt set, evaluated every N published versions by the
generators, between their training batches (docs/eval.md).

The broker schedules the rounds (:class:`EvalScheduler`): when the announced version enters a new
multiple of ``every_versions`` (version 0 included), and once more for the final version when the
learner marks the run done, it appends the held-out prompts to the ``eval_prompts`` stream, each
entry tagged with the round (the version that triggered it) and the sampling to use. Generators
claim them through the consumer group ``generators`` (generators/eval.py), generate greedily
and/or ``samples`` completions at the training temperature with the version they serve (at least
the round's), score them through the reward service, and append one entry per prompt to
``eval_results`` with the version that answered it. A round is labelled with that version (the
one that answered most of its prompts when several did), never with the version that triggered it. Nothing of this reaches the broker's ingest, the admission counters or the
learner: evaluation never changes what is trained.

:class:`EvalHistory` aggregates the results per round: pass@1, pass@k, mean reward and mean
response length; the dashboard, ``/metrics``, ``relay up``'s ``summary.json`` and the run records
read it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter, defaultdict
from dataclasses import replace
from math import comb

import redis
from pydantic import Field

from broker.client import queues
from broker.client.announcements import latest_announcement
from broker.client.telemetry import emit_event
from broker.runtime.config import StrictModel
from broker.prompts.datasets import DatasetConfig, Position
from broker.protocol.keys import Keys
from broker.protocol.messages import EvalCompletion, EvalResult, EvalRound, decode_eval_result
from broker.protocol.signing import AnnounceVerifier

log = logging.getLogger("relay.broker.eval")


class EvalConfig(StrictModel):
    """Evaluation on a held-out set during training."""

    every_versions: int = Field(
        100,
        ge=0,
        description="evaluate when the announced version reaches a new multiple "
        "of this (version 0 included); 0 = no evaluation",
    )
    final: bool = Field(True, description="also evaluate the last version when the learner finishes")
    final_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="relay up waits at most this long after the "
        "learner is done for the generators to answer the final round and exit",
    )
    prompts: int = Field(32, ge=1, le=100_000, description="held-out prompts per round")
    greedy: bool = Field(True, description="one greedy completion per prompt (top_k = 1); pass@1 is its correctness")
    samples: int = Field(
        0,
        ge=0,
        le=256,
        description="k completions per prompt at the training temperature, for "
        "pass@k (0 = none; without greedy, pass@1 is estimated from them)",
    )
    max_tokens: int | None = Field(
        None, ge=1, description="most new tokens per completion; null = the generators' sampling.max_tokens"
    )
    threshold: float = Field(1.0, description="a completion is correct when its reward is at least this")
    dataset: DatasetConfig | None = Field(
        None,
        description="the held-out set (same fields as broker.dataset; "
        "its first `prompts` records in its order); null = prompts of the "
        "built-in task drawn with `seed`, or broker.dataset's rows before its "
        "`start` when it has one",
    )
    seed: int = Field(
        1_000_003, description="seed of the built-in task's held-out prompts (differs from the training seed)"
    )


# ------------------------------------------------------------------------------------------------
# scheduling (broker)


class EvalScheduler:
    """Appends a round of held-out prompts when one is due (call :meth:`tick` from the broker loop)."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        cfg: EvalConfig,
        make_source,
        check_every_s: float = 0.2,
        announce_key: AnnounceVerifier | None = None,
    ):
        self.r, self.keys, self.cfg = r, keys, cfg
        self.announce_key = announce_key
        self.make_source = make_source  # () -> a source with take(k, Position), or None while not ready
        self.check_every_s = check_every_s
        self._next_check = 0.0
        self._records = None
        self.rounds: dict[int, EvalRound] = read_rounds(r, keys)
        self.history = EvalHistory(r, keys, settler=True)
        self._next_settle = 0.0

    def _held_out(self):
        if self._records is None:
            source = self.make_source()
            if source is None:
                return None
            got, _ = source.take(self.cfg.prompts, Position())
            if not got:
                raise ValueError("the evaluation set yielded no prompts")
            self._records = [rec for _, _, rec in got]
            if len(self._records) < self.cfg.prompts:
                log.warning(
                    "the evaluation set has only %d prompts (eval.prompts = %d)", len(self._records), self.cfg.prompts
                )
        return self._records

    def settle(self, every_s: float = 2.0) -> list[int]:
        """At most every ``every_s``: complete rounds summarised for good and their per-prompt results
        deleted (:meth:`EvalHistory.settle`); the rounds settled now."""
        if not self.rounds or time.monotonic() < self._next_settle:
            return []
        self._next_settle = time.monotonic() + every_s
        settled = self.history.settle()
        for v in settled:
            log.info("evaluation round %d settled: its summary kept, its per-prompt results deleted", v)
        return settled

    def tick(self) -> int | None:
        """Enqueue a due round; return its version (None when nothing was due)."""
        every = self.cfg.every_versions
        if not every or time.monotonic() < self._next_check:
            return None
        self._next_check = time.monotonic() + self.check_every_s
        latest = latest_announcement(self.r, self.keys, self.announce_key)
        if latest is None:
            return None
        v = latest.version
        done_rounds = {x // every for x, m in self.rounds.items() if not m.final}
        done = bool(self.r.exists(self.keys.done))
        if v in self.rounds or (v // every in done_rounds and not (self.cfg.final and done)):
            return None
        final = done
        records = self._held_out()
        if records is None:
            return None
        meta = EvalRound(
            version=v,
            prompts=len(records),
            greedy=self.cfg.greedy,
            samples=self.cfg.samples,
            threshold=self.cfg.threshold,
            final=final,
            enqueued_at=time.time(),
        )
        pipe = self.r.pipeline(transaction=True)  # the round's prompts and its record together
        for i, rec in enumerate(records):
            queues.add_prompt(
                pipe,
                self.keys.eval_prompts,
                replace(
                    rec,
                    round=v,
                    idx=i,
                    greedy=self.cfg.greedy,
                    samples=self.cfg.samples,
                    max_tokens=self.cfg.max_tokens or 0,
                ),
            )
        pipe.hset(self.keys.eval_rounds, str(v), meta.encode())
        pipe.execute()
        self.rounds[v] = meta
        emit_event(self.r, self.keys, "eval_round", version=v, prompts=len(records), final=final)
        log.info("evaluation round at version %d: %d prompts%s", v, len(records), " (final)" if final else "")
        return v


# ------------------------------------------------------------------------------------------------
# aggregation (anyone who can read Redis)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_round(meta: EvalRound) -> EvalRound:
    """``meta`` when its fields have the types the aggregation needs; ValueError naming the field."""
    for name in ("version", "prompts", "samples"):
        if not isinstance(getattr(meta, name), int) or isinstance(getattr(meta, name), bool) or getattr(meta, name) < 0:
            raise ValueError(f"{name} is not a non-negative integer: {getattr(meta, name)!r:.40}")
    if not _finite(meta.threshold):
        raise ValueError(f"threshold is not a finite number: {meta.threshold!r:.40}")
    return meta


def check_result(res: EvalResult) -> EvalResult:
    """``res`` when every completion has a finite reward (or none, failed), a status string and an integer
    length, and the version is an integer or null; ValueError naming what is wrong."""
    if res.version is not None and (not isinstance(res.version, int) or isinstance(res.version, bool)):
        raise ValueError(f"version is not an integer: {res.version!r:.40}")
    if not isinstance(res.samples, list):
        raise ValueError("samples is not a list")
    for c in ([res.greedy] if res.greedy is not None else []) + res.samples:
        if not isinstance(c, EvalCompletion):
            raise ValueError("a completion is not an object")
        if c.reward is not None and not _finite(c.reward):
            raise ValueError(f"a reward is not a finite number: {c.reward!r:.40}")
        if not isinstance(c.status, str) or not isinstance(c.length, int) or isinstance(c.length, bool):
            raise ValueError("a completion's status is not a string or its length not an integer")
    return res


def read_rounds(r: redis.Redis, keys: Keys, malformed: Counter | None = None) -> dict[int, EvalRound]:
    """The rounds enqueued so far, by version; an unreadable one is skipped, logged and counted in
    ``malformed`` (under ``eval_rounds``)."""
    out = {}
    for v, m in r.hgetall(keys.eval_rounds).items():
        try:
            out[int(v)] = check_round(EvalRound.decode(m))
        except ValueError as e:  # ProtocolError is a ValueError
            if malformed is not None:
                malformed["eval_rounds"] += 1
            log.warning("skipped the unreadable evaluation round %r: %s", v[:40], e)
    return out


def summarize_round(meta: EvalRound, results: dict[int, EvalResult]) -> dict:
    """One round's numbers from its per-prompt results (``idx -> result``; generators/eval.py)."""
    thr, k, greedy = meta.threshold, meta.samples, meta.greedy

    def correct(c: EvalCompletion) -> bool:
        return c.ok and float(c.reward) >= thr - 1e-9

    firsts, at_k, rewards, lengths, failures = [], [], [], [], 0
    sample_rewards = []
    for res in results.values():
        samples = res.samples
        comps = ([res.greedy] if greedy and res.greedy else []) + samples
        failures += sum(not c.ok for c in comps)
        if greedy and res.greedy:
            g = res.greedy
            firsts.append(1.0 if correct(g) else 0.0)
            if g.ok:
                rewards.append(float(g.reward))
            lengths.append(g.length)
        elif samples:
            firsts.append(pass_at_k(len(samples), sum(map(correct, samples)), 1))
            rewards.extend(float(c.reward) for c in samples if c.ok)
            lengths.extend(c.length for c in samples)
        if k and samples:
            at_k.append(pass_at_k(len(samples), sum(map(correct, samples)), min(k, len(samples))))
            sample_rewards.extend(float(c.reward) for c in samples if c.ok)
    served = Counter(r.version for r in results.values() if r.version is not None)
    # the label is the version that answered (the round's own is only the one that triggered it): the one
    # that answered the most prompts, the older on a tie; ``mixed`` when generators at different versions
    # split the round
    answered = max(served, key=lambda v: (served[v], -v)) if served else meta.version
    out = {
        "version": answered,
        "round": meta.version,
        "pass@1": _mean(firsts),
        "pass@k": _mean(at_k) if k else None,
        "k": k or None,
        "mean_reward": _mean(rewards),
        "mean_length": _mean([float(x) for x in lengths]),
        "n_prompts": len(results),
        "prompts": meta.prompts,
        "complete": len(results) >= meta.prompts,
        "reward_failures": failures,
        "versions_served": sorted(served),
        "mixed": len(served) > 1,
        "final": meta.final,
    }
    if greedy and k:
        out["sample_mean_reward"] = _mean(sample_rewards)
    return out


class EvalHistory:
    """The rounds so far, read incrementally from Redis (``rounds()`` is cheap to call every second).
    A result or round that cannot be read (not JSON, a field of the wrong type, a reward that is not a
    finite number) is skipped, logged and counted in ``malformed`` (``eval_results``: each entry once;
    ``eval_rounds``: at the last read, with the unreadable summaries); it never stops the other rounds
    from being summarised.

    A complete round is summarised once for good (:meth:`settle`, the broker's loop): its summary goes to
    ``eval_summaries`` and its per-prompt results leave ``eval_results``, so a run's evaluation costs Redis
    (and every reader's memory) one summary per round, not one entry per prompt per round."""

    def __init__(self, r: redis.Redis, keys: Keys, settler: bool = False):
        self.r, self.keys = r, keys
        self.settler = settler  # the broker's: keeps the entry ids it reads, for settle() to delete
        self._after = "-"
        self._lock = threading.Lock()  # the dashboard's HTTP threads read one history concurrently
        self._results: dict[int, dict[int, EvalResult]] = defaultdict(dict)
        self._ids: dict[int, list[bytes]] = defaultdict(list)  # entry ids read, by round (settler only)
        self._settled: dict[int, dict] = {}
        self._summaries_bad = 0  # unreadable summaries at the last full read of the hash
        self.malformed: Counter = Counter(eval_results=0, eval_rounds=0)

    def rounds(self) -> list[dict]:
        with self._lock:
            return self._rounds()

    def _rounds(self) -> list[dict]:
        rounds_bad: Counter = Counter()
        meta = read_rounds(self.r, self.keys, rounds_bad)
        while True:
            entries = queues.read_eval_results(self.r, self.keys, self._after)
            if not entries:
                break
            for eid, f in entries:
                try:
                    v = int(f[b"round"])
                    if self.settler:
                        self._ids[v].append(eid)
                    res = check_result(decode_eval_result(f[b"data"]))
                    # a prompt evaluated twice (reclaimed after a generator died) counts once
                    if v not in self._settled:
                        self._results[v].setdefault(int(f[b"idx"]), res)
                except (KeyError, ValueError) as e:  # ProtocolError is a ValueError
                    self.malformed["eval_results"] += 1
                    log.warning("skipped the unreadable evaluation result %s: %s", eid, e)
            self._after = entries[-1][0].decode()
        # the summaries after the results: a round settled between the two reads is in this one. A summary
        # never changes once written, so the hash is read again only when it has more fields.
        if self.r.hlen(self.keys.eval_summaries) != len(self._settled) + self._summaries_bad:
            bad: Counter = Counter()
            self._settled = read_summaries(self.r, self.keys, bad)
            self._summaries_bad = bad["eval_rounds"]
            for v in self._settled:
                self._results.pop(v, None)
        self.malformed["eval_rounds"] = rounds_bad["eval_rounds"] + self._summaries_bad
        return [
            self._settled[v] if v in self._settled else summarize_round(meta[v], self._results.get(v, {}))
            for v in sorted(meta)
        ]

    def settle(self) -> list[int]:
        """Store each complete round's summary in ``eval_summaries`` and delete its results from
        ``eval_results``, in one MULTI/EXEC; delete the late results of rounds already settled (a prompt
        answered twice). The broker's loop calls it; the rounds settled now, by version. An incomplete
        round (its generators gone before answering every prompt) keeps its results."""
        if not self.settler:
            raise RuntimeError("only the broker's EvalHistory(settler=True) settles rounds")
        with self._lock:
            return self._settle()

    def _settle(self) -> list[int]:
        rounds = self._rounds()
        pipe = self.r.pipeline(transaction=True)
        settled = []
        for s in rounds:
            v = s["round"]
            if v not in self._settled and s["complete"]:
                pipe.hset(self.keys.eval_summaries, str(v), json.dumps(s))
                settled.append(v)
            elif v not in self._settled:
                continue
            ids = self._ids.pop(v, None)
            if ids:
                queues.delete_entries(pipe, self.keys.eval_results, *ids)
        if len(pipe):
            pipe.execute()
        for v in settled:
            self._results.pop(v, None)
        return settled


def read_summaries(r: redis.Redis, keys: Keys, malformed: Counter | None = None) -> dict[int, dict]:
    """The summaries of the settled rounds, by round version; an unreadable one is skipped, logged and
    counted in ``malformed`` (under ``eval_rounds``)."""
    out = {}
    for v, raw in r.hgetall(keys.eval_summaries).items():
        try:
            s = json.loads(raw)
            if not isinstance(s, dict) or s.get("round") != int(v) or not isinstance(s.get("complete"), bool):
                raise ValueError("not a round's summary")
            out[int(v)] = s
        except ValueError as e:  # JSONDecodeError is a ValueError
            if malformed is not None:
                malformed["eval_rounds"] += 1
            log.warning("skipped the unreadable evaluation summary %r: %s", v[:40], e)
    return out


def history_for_summary(r: redis.Redis, keys: Keys) -> list[dict]:
    """summary.json's ``eval``: one entry per round, oldest first."""
    return EvalHistory(r, keys).rounds()
