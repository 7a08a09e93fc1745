"""Evaluation rounds, served by a generator between its training batches (broker/prompts/evals.py
schedules them; docs/eval.md).

A generator claims held-out prompts from ``eval_prompts`` (consumer group ``generators``; prompts
left by a dead generator are reclaimed after ``claim_idle_s``), ``prompts_per_batch`` at a time until
none is waiting (no weight update in between, so what it answers comes from one version), makes
sure it serves at least the round's version, generates greedily (top_k = 1) and/or ``samples`` completions at the training
temperature, scores them through the reward service like training groups, and appends one entry per
prompt to ``eval_results`` while acknowledging the prompt, in one MULTI/EXEC. Nothing goes to the
broker's ingest or the admission counters: evaluation does not change what is trained.
"""

from __future__ import annotations

import logging
import time
import zlib

from broker.client import queues
from broker.protocol.messages import EvalCompletion, EvalResult, PromptEntry, encode_eval_result
from generators.episodes import EpisodeStats
from generators.prompts import prompt_token_ids

log = logging.getLogger("relay.generator.eval")


class Evaluator:
    def __init__(self, gen, check_every_s: float = 0.25, final_wait_s: float = 10.0):
        self.gen, self.r, self.keys = gen, gen.r, gen.keys
        self.check_every_s, self.final_wait_s = check_every_s, final_wait_s
        self._next_check = 0.0
        self.episode_stats = EpisodeStats()  # evaluation episodes (multi-turn tasks), apart from training's

    def _claim(self) -> list[tuple[bytes, PromptEntry]]:
        n, stream = self.gen.cfg.prompts_per_batch, self.keys.eval_prompts
        out = queues.claim_abandoned(self.r, stream, self.gen.cfg.id, self.gen.cfg.claim_idle_s, n)
        if len(out) < n:
            out += queues.claim_new(self.r, stream, self.gen.cfg.id, n - len(out))
        self.gen.leases.hold(stream, [eid for eid, _ in out])
        return out

    def serve(self, force: bool = False) -> int:
        """Evaluate the waiting held-out prompts, batch after batch until none is left, with no weight
        update between batches unless a batch needs a newer version (so the prompts one generator
        answers come from one version: a round's label, broker/prompts/evals.py); return how many."""
        if not force and time.monotonic() < self._next_check:
            return 0
        self._next_check = time.monotonic() + self.check_every_s
        total = 0
        while not self.gen.stop.is_set():  # claimed prompts are left pending when stopped (reclaimed later)
            try:
                claimed = self._claim()
            except Exception as e:  # noqa: BLE001 - the stream or group may not exist (an older broker): no eval
                if "NOGROUP" in str(e):
                    return total
                raise
            if not claimed:
                return total
            total += self._answer(claimed)
            self.gen.send_heartbeat()  # a long round must not look like a dead generator
        return total

    def _answer(self, claimed: list[tuple[bytes, PromptEntry]]) -> int:
        """Generate, score and record one batch of claimed held-out prompts."""
        need = max(p.round for _, p in claimed)
        weights = self.gen.weights
        if weights.version is None or weights.version < need:
            weights.update()  # the round was enqueued after its version was announced
        backend, base = self.gen.backend, self.gen.cfg.sampling
        first = claimed[0][1]
        greedy, k = first.greedy, first.samples
        max_tokens = first.max_tokens or base.max_tokens
        prompts = [p for _, p in claimed]
        # a multi-turn task: each held-out prompt is answered by episodes too, on this one version (no
        # update between turns), counted apart from the training episodes
        runner = self.gen._episode_runner() if self.gen.cfg.episodes.env else None
        ids = [runner.prompt_ids(p) if runner else prompt_token_ids(p, backend.encode) for p in prompts]
        version = weights.version
        seed = zlib.crc32(f"eval:{self.gen.cfg.seed}:{self.gen.cfg.id}:{claimed[0][0]!r}".encode())
        results = [EvalResult(version=version, generator=self.gen.cfg.id) for _ in prompts]
        runs = []
        if greedy:
            runs.append(
                (
                    "greedy",
                    base.model_copy(
                        update={"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 1, "max_tokens": max_tokens}
                    ),
                )
            )
        if k:
            runs.append(("samples", base.model_copy(update={"n": k, "max_tokens": max_tokens})))
        for name, sampling in runs:
            if runner is not None:
                groups = runner.run(
                    prompts, ids, seed, sampling=sampling, between_turns=lambda: version, stats=self.episode_stats
                )
            else:
                groups = backend.generate(ids, sampling, seed=seed)
            scores = self.gen.rewards.score_groups(prompts, groups, backend.decode)
            for res, cs, rs in zip(results, groups, scores):
                comps = [
                    EvalCompletion(
                        reward=r.score if r.status == "ok" else None,
                        status=r.status,
                        length=len(c.token_ids),
                        finish_reason=c.finish_reason,
                    )
                    for c, r in zip(cs, rs)
                ]
                if name == "greedy":
                    res.greedy = comps[0]
                else:
                    res.samples = comps
        pipe = self.r.pipeline(transaction=True)
        for (eid, p), res in zip(claimed, results):
            queues.add_eval_result(pipe, self.keys, p.round, p.idx, encode_eval_result(res))
            queues.release(pipe, self.keys.eval_prompts, eid)
            self.gen.leases.release(self.keys.eval_prompts, eid)
        pipe.execute()
        return len(claimed)

    def finish(self) -> None:
        """The learner is done: serve the last version's evaluation round (when evaluation is on)
        before exiting, waiting up to ``final_wait_s`` for the broker to enqueue it."""
        if not self.r.exists(self.keys.eval_rounds):
            return  # evaluation is off (no round was ever enqueued)
        self.gen.weights.update()
        deadline = time.monotonic() + self.final_wait_s
        while (
            time.monotonic() < deadline
            and not self.gen.stop.is_set()
            and not self.r.hexists(self.keys.eval_rounds, str(self.gen.weights.version))
        ):
            time.sleep(0.1)
        self.serve(force=True)
