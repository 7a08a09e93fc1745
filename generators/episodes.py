"""Multi-turn episodes: the generator's runner of environment episodes (docs/agents.md).

An episode is one sample: the prompt, then model turns and the environment's replies in between,
until the environment says ``done`` or a budget runs out (``max_turns``, the episode's token budget,
its timeout). Token in, token out: the sample is the exact token sequence the model saw and produced.
A model turn's tokens are the ids sampled (never re-tokenised from text); an environment reply is
rendered in the model's format and appended as *context* tokens (trainable 0, log-prob 0.0, the
current version). Every token records the weight version that sampled it (or, for context, that
was serving when it was appended): weights may change between turns (the between-turns hook applies
a newer announced version) and, with the "continue" in-flight policy, within a turn.

Asynchronous: many episodes are in flight. Each round, every episode ready to sample is batched into
one ``backend.generate`` call (its whole token context as the prompt, n = 1); the environment steps
(a tool run, an HTTP call) run on a thread pool, and an episode whose step has not returned does not
hold the others up: they keep sampling, it joins a later round.

Failures are never silent: an :class:`~generators.envs.base.EnvError` (or any exception from an
environment plugin, or ``info["error"]``) ends the episode; it is counted by reason and its sample's
reward is failed (the reward client marks it, plugin ``env:<name>``), never invented.

Template drift: for a tokenizer with a chat template, each finished episode's conversation is
re-rendered through the template and compared with the tokens actually used; a difference is
counted (``template_drift``) and recorded in the sample's episode info, never silently fixed.

Unspellable replies: an environment reply whose text the tokenizer cannot spell (its tokens decode to
other text: the tiny model's digits-and-tool-markers vocabulary reads ``higher`` as ``<pad>``) reaches the
model as something else. Each is counted (``unspellable_replies`` in the episode stats and the sample's
episode info) and logged with what the model saw instead; the episode goes on (the model still sees what
the tokens say).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from broker.protocol.messages import PromptEntry
from generators.backends.base import Completion, StepHook
from generators.config import SamplingConfig
from generators.chat_render import check_tool_vocabulary, make_renderer
from generators.envs.base import EnvError, Environment, StepResult

log = logging.getLogger("relay.generator.episodes")

# after a round's environment steps are submitted, wait this long for them before the next round's
# batch: fast steps (a calculator) join it; a slow one is left behind and joins a later round
JOIN_WAIT_S = 0.02


@dataclass
class EpisodeLimits:
    """The budgets of one episode."""

    max_turns: int = 4  # most model turns
    max_tokens: int = 48  # most tokens after the prompt, model and context together
    timeout_s: float = 60.0  # wall-clock seconds from its start; then it ends as failed ("timeout")


class EpisodeStats:
    """Counters across all episodes of a generator, read by its heartbeat and ``/metrics``."""

    def __init__(self):
        self._lock = threading.Lock()
        self.episodes = 0  # episodes finished (any way)
        self.turns = 0  # model turns in them
        self.tool_calls: dict[str, int] = {}  # tool -> calls
        self.tool_failures: dict[str, int] = {}  # tool -> failed calls
        self.env_failures: dict[str, int] = {}  # reason -> episodes ended by an environment failure
        self.env_steps = 0  # reset + step calls that returned
        self.env_seconds = 0.0  # their total latency
        self.truncated = 0  # episodes ended by a budget (finish_reason "length")
        self.template_drift = 0  # episodes whose tokens differ from the chat template's rendering
        self.unspellable = 0  # environment replies whose text the tokenizer cannot spell

    def env_call(self, seconds: float) -> None:
        with self._lock:
            self.env_steps += 1
            self.env_seconds += seconds

    def tool(self, name: str, ok: bool) -> None:
        with self._lock:
            self.tool_calls[name] = self.tool_calls.get(name, 0) + 1
            if not ok:
                self.tool_failures[name] = self.tool_failures.get(name, 0) + 1

    def unspellable_reply(self) -> None:
        with self._lock:
            self.unspellable += 1

    def finished(self, turns: int, error: str, truncated: bool, drift: bool) -> None:
        with self._lock:
            self.episodes += 1
            self.turns += turns
            if error:
                reason = error.split(":", 1)[0]
                self.env_failures[reason] = self.env_failures.get(reason, 0) + 1
            self.truncated += truncated
            self.template_drift += drift

    def snapshot(self) -> dict[str, Any]:
        """What the heartbeat reports (JSON values; docs/protocol.md's Heartbeat.episodes: totals, and the means)."""
        with self._lock:
            return {
                "episodes": self.episodes,
                "turns": self.turns,
                "env_seconds": round(self.env_seconds, 6),
                "turns_mean": round(self.turns / self.episodes, 3) if self.episodes else 0.0,
                "tool_calls": dict(self.tool_calls),
                "tool_failures": dict(self.tool_failures),
                "env_failures": dict(self.env_failures),
                "env_steps": self.env_steps,
                "env_latency_s": round(self.env_seconds / self.env_steps, 6) if self.env_steps else 0.0,
                "truncated": self.truncated,
                "template_drift": self.template_drift,
                "unspellable_replies": self.unspellable,
            }


# -- one episode --------------------------------------------------------------------------------------


@dataclass
class _TokenMarks:
    """Per token of an episode, beside its id: the behaviour log-prob, the version that sampled it (context
    tokens: the version of the turn they follow), and 1 when it is trained (sampled), 0 (context)."""

    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    trainable: list[int] = field(default_factory=list)


@dataclass
class _Episode:
    group: int  # the prompt's index in the batch
    prompt: PromptEntry
    prompt_ids: list[int]
    env: Environment | None
    deadline: float
    messages: list[dict]
    tokens: list[int] = field(default_factory=list)  # after the prompt: the model's and the context's
    marks: _TokenMarks = field(default_factory=_TokenMarks)  # each token's log-prob, version, trainable
    answer: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_failures: dict[str, int] = field(default_factory=dict)
    env_seconds: float = 0.0
    state: str = "pending"  # pending (an environment call runs) | ready (to sample) | done
    future: cf.Future | None = None
    error: str = ""
    finish_reason: str = "stop"
    env_reward: float | None = None
    drift: bool = False
    unspellable: int = 0  # replies the tokenizer could not spell

    def add(self, ids: list[int], lps: list[float], versions: list[int], trainable: int) -> None:
        self.tokens += ids
        self.marks.logprobs += lps
        self.marks.versions += versions
        self.marks.trainable += [trainable] * len(ids)

    def completion(self) -> Completion:
        info: dict[str, Any] = {
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_failures_by_tool": dict(self.tool_failures),
            "env_seconds": round(self.env_seconds, 6),
        }
        if self.error:
            info["error"] = self.error
        if self.drift:
            info["template_drift"] = True
        if self.unspellable:
            info["unspellable_replies"] = self.unspellable
        m = self.marks
        return Completion(
            list(self.tokens),
            list(m.logprobs),
            self.finish_reason,
            list(m.versions),
            trainable=list(m.trainable),
            env_reward=self.env_reward,
            answer_ids=list(self.answer),
            episode=info,
        )


def _timed(fn, *args) -> tuple[str, Any, float]:
    """Run an environment call on a worker: (outcome, value, seconds); outcome "ok", or "error" with
    the failure's reason (an EnvError's code, or the exception's type for a plugin's bug)."""
    t0 = time.monotonic()
    try:
        return "ok", fn(*args), time.monotonic() - t0
    except EnvError as e:
        return "error", str(e)[:300], time.monotonic() - t0  # "reason: detail"
    except Exception as e:  # noqa: BLE001 - a plugin's bug ends its episode, counted by type (never silent)
        log.warning("environment call failed: %s: %s", type(e).__name__, e, exc_info=True)
        return "error", f"exception_{type(e).__name__}: {e}"[:300], time.monotonic() - t0


class EpisodeRunner:
    """Runs a batch of prompts × ``sampling.n`` episodes (see the module's docstring).

    backend:       the generator's backend (``generate``, ``decode``, and its tokenizer for rendering)
    engine_lock:   held around each ``generate`` (the generator's engine lock: its other users take turns)
    env_factory:   () -> a new :class:`Environment` (one per episode)
    between_turns: () -> the version serving from now on; called before every sampling round, where
                   the generator applies a newer announced version (``WeightApplier.update``)
    """

    def __init__(
        self,
        backend,
        env_factory: Callable[[], Environment],
        sampling: SamplingConfig,
        limits: EpisodeLimits,
        between_turns: Callable[[], int | None],
        renderer=None,
        threads: int = 16,
        stats: EpisodeStats | None = None,
        env_name: str = "",
        engine_lock: threading.RLock | None = None,
    ):
        self.backend, self.env_factory, self.sampling, self.limits = backend, env_factory, sampling, limits
        self.engine_lock = engine_lock if engine_lock is not None else threading.RLock()  # held while sampling
        self.between_turns = between_turns
        self.renderer = renderer if renderer is not None else make_renderer(backend)
        self.stats = stats if stats is not None else EpisodeStats()
        self.env_name = env_name
        self.pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="env")
        self.rounds = 0  # backend.generate calls made (one per round)
        self.misspelled = 0  # replies the tokenizer could not spell (training and evaluation: for the log)
        self.version = -1

    def prompt_ids(self, prompt: PromptEntry) -> list[int]:
        """The token ids an episode of ``prompt`` starts from (the chat template's rendering, if any)."""
        return self.renderer.prompt_ids(prompt)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- the loop ------------------------------------------------------------------------------------

    def run(
        self,
        prompts: list[PromptEntry],
        prompt_ids: list[list[int]],
        seed: int,
        on_step: StepHook | None = None,
        sampling: SamplingConfig | None = None,
        between_turns: Callable[[], int | None] | None = None,
        stats: EpisodeStats | None = None,
    ) -> list[list[Completion]]:
        """Each prompt's ``sampling.n`` episodes, as completions (same shape as ``backend.generate``).
        ``sampling``, ``between_turns`` and ``stats`` override the runner's for this call (evaluation
        rounds: greedy sampling, one version throughout, counted apart from training)."""
        saved = self.sampling, self.between_turns, self.stats
        self.sampling = sampling or self.sampling
        self.between_turns = between_turns or self.between_turns
        self.stats = stats or self.stats
        try:
            return self._run(prompts, prompt_ids, seed, on_step)
        finally:
            self.sampling, self.between_turns, self.stats = saved

    def _run(self, prompts, prompt_ids, seed, on_step) -> list[list[Completion]]:
        now = time.monotonic()
        episodes: list[_Episode] = []
        for g, (p, ids) in enumerate(zip(prompts, prompt_ids)):
            for _ in range(self.sampling.n):
                # the conversation so far: the dataset's chat messages the prompt's ids render, else its text
                start = [dict(m) for m in p.messages] if p.messages else [{"role": "user", "content": p.text}]
                e = _Episode(g, p, list(ids), None, now + self.limits.timeout_s, start)
                try:
                    e.env = self.env_factory()
                    e.future = self.pool.submit(_timed, e.env.reset, p)
                except Exception as ex:  # noqa: BLE001 - the factory failed: this episode fails, counted
                    e.error, e.state = f"exception_{type(ex).__name__}: {ex}"[:300], "ready"
                episodes.append(e)
        self._wait([e for e in episodes if e.state == "pending"], JOIN_WAIT_S)
        while True:
            self._harvest(episodes)
            live = [e for e in episodes if e.state != "done"]
            if not live:
                break
            ready = [e for e in live if e.state == "ready"]
            if not ready:  # every live episode waits on its environment: wait for the first one back
                pending = [e.future for e in live if e.future is not None]
                wait_s = max(0.0, min(e.deadline for e in live) - time.monotonic())
                cf.wait(pending, timeout=min(wait_s, 1.0) + 1e-3, return_when=cf.FIRST_COMPLETED)
                continue
            v = self.between_turns()
            self.version = v if v is not None else -1
            self._sample(ready, seed, on_step)
            self._wait([e for e in live if e.state == "pending"], JOIN_WAIT_S)
        out: list[list[Completion]] = [[] for _ in prompts]
        for e in episodes:
            out[e.group].append(e.completion())
        return out

    @staticmethod
    def _wait(episodes: list[_Episode], timeout_s: float) -> None:
        futures = [e.future for e in episodes if e.future is not None]
        if futures:
            cf.wait(futures, timeout=timeout_s)

    def _sample(self, ready: list[_Episode], seed: int, on_step: StepHook | None) -> None:
        """One round: one backend.generate call for every ready episode; then their environment steps."""
        room = [self.limits.max_tokens - len(e.tokens) for e in ready]
        cap = max(1, min(self.sampling.max_tokens, max(room)))
        sampling = self.sampling.model_copy(update={"n": 1, "max_tokens": cap})
        self.rounds += 1
        with self.engine_lock:
            groups = self.backend.generate(
                [e.prompt_ids + e.tokens for e in ready],
                sampling,
                seed=zlib.crc32(f"{seed}:{self.rounds}".encode()),
                on_step=on_step,
            )
        for e, r, (c,) in zip(ready, room, groups):
            ids = c.token_ids[:r]  # an episode with less room than the round's cap: its turn is cut there
            versions = (c.versions if c.versions is not None else [self.version] * len(c.token_ids))[:r]
            e.add(ids, c.logprobs[:r], versions, 1)
            e.answer = list(ids)
            e.turns += 1
            e.messages.append({"role": "assistant", "content": self.backend.decode(ids)})
            if e.error:  # the environment failed at reset: the episode ends after its first turn, failed
                self._end(e)
            elif len(ids) < len(c.token_ids) or (
                c.finish_reason == "length" and len(e.tokens) >= self.limits.max_tokens
            ):
                self._end(e, "length")  # the episode's token budget ran out within the turn
            else:
                e.state, e.future = "pending", self.pool.submit(_timed, e.env.step, e.messages[-1]["content"])

    def _harvest(self, episodes: list[_Episode]) -> None:
        """Take in the environment calls that returned; end episodes past their deadline."""
        now = time.monotonic()
        for e in episodes:
            if e.state == "done":
                continue
            if e.state == "pending" and e.future is not None and e.future.done():
                outcome, value, seconds = e.future.result()
                e.future = None
                e.env_seconds += seconds
                self.stats.env_call(seconds)
                if outcome != "ok":
                    e.error = value
                    if e.turns:  # a failed step ends the episode; a failed reset: after its first turn
                        self._end(e)
                    else:
                        e.state = "ready"
                elif e.turns == 0:
                    e.state = "ready"  # reset returned
                else:
                    self._take_step(e, value)
            if e.state != "done" and now > e.deadline:
                e.error = e.error or f"timeout: episode still running after {self.limits.timeout_s}s"
                self._end(e)

    def _take_step(self, e: _Episode, res: StepResult) -> None:
        if not isinstance(res, StepResult):
            e.error = f"bad_reply: step returned {type(res).__name__}, not a StepResult"
            return self._end(e)
        for tc in res.tool_calls:
            e.tool_calls += 1
            self.stats.tool(tc.name, tc.ok)
            if not tc.ok:
                e.tool_failures[tc.name] = e.tool_failures.get(tc.name, 0) + 1
        if res.info.get("error"):
            e.error = str(res.info["error"])[:300]
            return self._end(e)
        if res.done:
            e.env_reward = None if res.reward is None else float(res.reward)
            return self._end(e)
        if e.turns >= self.limits.max_turns:
            return self._end(e, "length")
        ctx = self.renderer.reply_ids(e.messages, e.answer, res.reply, res.role) if res.reply is not None else []
        if res.reply is not None:
            self._check_spelling(e, res.reply)
        if len(e.tokens) + len(ctx) >= self.limits.max_tokens:  # no room left for a model token
            return self._end(e, "length")
        e.add(ctx, [0.0] * len(ctx), [self.version] * len(ctx), 0)
        if res.reply is not None:
            e.messages.append({"role": res.role, "content": res.reply})
        e.state = "ready"

    def _check_spelling(self, e: _Episode, reply: str) -> None:
        """Count a reply the tokenizer cannot spell; log the runner's 1st, 10th, 100th, ... of them."""
        seen = self.renderer.misspelled(reply)
        if seen is None:
            return
        e.unspellable += 1
        self.stats.unspellable_reply()
        self.misspelled += 1
        n = self.misspelled
        if str(n).rstrip("0") == "1":  # 1, 10, 100, ...
            log.warning(
                "the %s environment replied %r, which the model's tokenizer cannot spell: the model reads %r "
                "(%d such replies so far, counted as unspellable_replies). Reply in text the tokenizer knows "
                "(the built-in tiny model spells digits, + = * and the tool markers) or use a model whose "
                "tokenizer spells it",
                self.env_name or "episode's",
                reply[:200],
                seen[:200],
                n,
            )

    def _end(self, e: _Episode, finish_reason: str = "stop") -> None:
        e.state, e.finish_reason = "done", finish_reason
        if not e.error and e.tokens:
            d = self.renderer.drift(e.messages, e.prompt_ids + e.tokens)
            if d:
                e.drift = True
                log.warning(
                    "template drift: an episode's tokens differ from the chat template's rendering of its "
                    "conversation (counted as template_drift)"
                )
        self.stats.finished(e.turns, e.error, finish_reason == "length", e.drift)
        env, fut = e.env, e.future
        if env is None:
            return
        if fut is not None and not fut.done():  # a step still runs (the episode timed out): close after it
            fut.add_done_callback(lambda _f: self._close(env))
        else:
            self._close(env)

    def _close(self, env: Environment) -> None:
        try:
            env.close()
        except Exception as ex:  # noqa: BLE001 - counted and logged; the episode's sample is already complete
            log.warning("environment close failed: %s: %s", type(ex).__name__, ex)
            with self.stats._lock:
                self.stats.env_failures["close"] = self.stats.env_failures.get("close", 0) + 1


class Episodes:
    """A generator's multi-turn episodes (``cfg.episodes.env``): the environment, built (its options checked) at start;
    the runner, built on first use, once the model (and its tokenizer, which renders the environment's
    replies) is loaded; and the training episodes' counters."""

    def __init__(self, cfg, backend, between_turns: Callable[[], int | None], engine_lock: threading.RLock):
        from generators.envs.registry import build_env

        self.cfg, self.backend, self.between_turns, self.engine_lock = cfg, backend, between_turns, engine_lock
        self.stats = EpisodeStats()
        self.env_factory = build_env(cfg.episodes.env, cfg.episodes.env_options)
        self._runner: EpisodeRunner | None = None

    def runner(self) -> EpisodeRunner:
        if self._runner is None:
            renderer = make_renderer(self.backend)
            check_tool_vocabulary(renderer, self.backend)
            c = self.cfg
            self._runner = EpisodeRunner(
                self.backend,
                self.env_factory,
                c.sampling,
                EpisodeLimits(c.episodes.max_turns, c.episodes.max_tokens, c.episodes.timeout_s),
                self.between_turns,
                renderer,
                threads=c.episodes.env_threads,
                stats=self.stats,
                env_name=c.episodes.env,
                engine_lock=self.engine_lock,
            )
        return self._runner

    def close(self) -> None:
        """The runner's pool, then what the environment's episodes share (a tool pool, an HTTP client)."""
        if self._runner is not None:
            self._runner.close()
        if hasattr(self.env_factory, "close"):
            self.env_factory.close()
