"""The multi-turn episode runner (generators/episodes.py) with a fake backend: what a sample holds
(masks, log-probs, versions across turns), one batched generate call per round, a slow environment
step not holding up other episodes, budgets, and failures counted (pure logic)."""

from __future__ import annotations

import threading
import time

import pytest

from broker.protocol.messages import PromptEntry
from generators.backends.base import Completion
from generators.config import GeneratorConfig, SamplingConfig
from generators.envs.base import Environment, StepResult
from generators.episodes import EpisodeLimits, EpisodeRunner, EpisodeStats
from generators.reward_client import RewardClient
from tests.support.episode_envs import CountEnv

EOS = 2
TURN = [5, 6, EOS]  # every model turn the fake backend samples
REPLY = [90, 91]  # every environment reply, as the fake renderer renders it


class FakeBackend:
    """Each row: TURN (cut at max_tokens), log-prob -0.5 each; records every call."""

    name = "fake"
    eos_token_id = EOS

    def __init__(self, delay_s: float = 0.0, turn=TURN):
        self.calls: list[tuple[list[list[int]], SamplingConfig, float]] = []
        self.delay_s, self.turn = delay_s, turn
        self.lock = threading.Lock()

    def decode(self, ids):
        return "".join(str(t) for t in ids if t != EOS)

    def generate(self, prompts, sampling, seed, on_step=None):
        with self.lock:
            self.calls.append(([list(p) for p in prompts], sampling, time.monotonic()))
        time.sleep(self.delay_s)
        t = self.turn[: sampling.max_tokens]
        done = t[-1] == EOS
        return [
            [Completion(list(t), [-0.5] * len(t), "stop" if done else "length") for _ in range(sampling.n)]
            for _ in prompts
        ]


class FakeRenderer:
    def __init__(self):
        self.replies: list[tuple[str, str]] = []

    def prompt_ids(self, p):
        return [1, 3, 4]

    def reply_ids(self, messages, turn_ids, reply, role):
        self.replies.append((reply, role))
        return list(REPLY)

    def drift(self, messages, used):
        return None

    def misspelled(self, reply):
        return None


def prompt(text="a", reference="56", **meta):
    return PromptEntry(text, reference, "count", metadata=meta)


def runner(backend=None, n=1, max_turns=4, max_tokens=48, timeout_s=30.0, done_after=2, versions=None):
    versions = iter(versions) if versions is not None else None
    return EpisodeRunner(
        backend or FakeBackend(),
        lambda: CountEnv(done_after=done_after),
        SamplingConfig(n=n, max_tokens=8),
        EpisodeLimits(max_turns, max_tokens, timeout_s),
        (lambda: next(versions)) if versions is not None else (lambda: 7),
        renderer=FakeRenderer(),
        threads=8,
        stats=EpisodeStats(),
        env_name="count",
    )


def run(r, prompts):
    return r.run(prompts, [r.prompt_ids(p) for p in prompts], seed=0)


def test_a_two_turn_episode_is_model_tokens_then_context_then_model_tokens():
    r = runner(versions=[3, 4])  # a new version is applied between the two turns
    [[c]] = run(r, [prompt(reference="56")])
    assert c.token_ids == TURN + REPLY + TURN
    assert c.trainable == [1, 1, 1, 0, 0, 1, 1, 1]  # the tool's reply is context, never trained
    assert c.logprobs == [-0.5] * 3 + [0.0] * 2 + [-0.5] * 3
    assert c.versions == [3, 3, 3, 3, 3, 4, 4, 4]  # each token: the version that sampled it
    assert c.answer_ids == TURN  # the final model turn, scored by the reward service
    assert c.finish_reason == "stop"
    assert c.env_reward == 1.0  # the last turn "56" equals the reference
    assert c.episode["turns"] == 2 and c.episode["tool_calls"] == 2 and "error" not in c.episode
    assert r.stats.snapshot()["episodes"] == 1 and r.stats.snapshot()["turns_mean"] == 2.0
    assert r.stats.tool_calls == {"count": 2}
    assert r.renderer.replies == [("1", "tool")]


def test_every_ready_episode_is_sampled_in_one_generate_call_per_round_with_its_full_context():
    b = FakeBackend()
    r = runner(b, n=3)
    groups = run(r, [prompt("a"), prompt("b")])
    assert [len(g) for g in groups] == [3, 3]
    assert len(b.calls) == 2  # two turns: two rounds, six episodes each
    first, second = b.calls[0], b.calls[1]
    assert first[1].n == 1 and len(first[0]) == 6 and first[0][0] == [1, 3, 4]
    assert second[0][0] == [1, 3, 4] + TURN + REPLY  # the whole context so far, token for token


def test_a_slow_environment_step_does_not_block_the_sampling_of_other_episodes():
    CountEnv.log.clear()
    b = FakeBackend()
    r = runner(b, done_after=4)
    t0 = time.monotonic()
    [[slow], [fast]] = run(r, [prompt("slow", sleep_s=1.0), prompt("fast")])
    elapsed = time.monotonic() - t0
    assert slow.episode["turns"] == fast.episode["turns"] == 4
    slow_first_step_end = next(t for ev, p, t in CountEnv.log if p == "slow" and ev == "step1-end")
    # the fast episode's turns 2..4 were sampled (alone) while the slow one's first step was still running
    before = [prompts for prompts, _, t in b.calls if t < slow_first_step_end]
    assert len(before) == 4 and len(before[0]) == 2 and all(len(ps) == 1 for ps in before[1:])
    assert slow.episode["env_seconds"] >= 3.0 and fast.episode["env_seconds"] < 0.5
    assert elapsed < 4 * 1.0 + 1.0  # the slow episode's four steps, not more


def test_max_turns_ends_an_episode_the_environment_does_not_end_as_length():
    r = runner(max_turns=3)
    [[c]] = run(r, [prompt(never_done=True)])
    assert c.episode["turns"] == 3 and c.finish_reason == "length"
    assert c.token_ids == TURN + REPLY + TURN + REPLY + TURN  # no reply appended after the last turn
    assert c.env_reward is None and r.stats.truncated == 1


def test_the_episode_token_budget_cuts_the_last_turn():
    r = runner(max_tokens=7)
    [[c]] = run(r, [prompt(never_done=True)])
    assert len(c.token_ids) == 7 and c.finish_reason == "length"
    assert c.token_ids == TURN + REPLY + TURN[:2] and c.trainable == [1, 1, 1, 0, 0, 1, 1]
    assert c.answer_ids == TURN[:2]


@pytest.mark.parametrize("meta,reason", [({"fail_at": 2}, "http_500"), ({"crash_at": 1}, "exception_ValueError")])
def test_an_environment_failure_ends_the_episode_counted_and_its_reward_is_failed(meta, reason):
    r = runner(done_after=3)
    [[bad], [good]] = run(r, [prompt("bad", **meta), prompt("good")])
    assert bad.episode["error"].startswith(reason) and bad.env_reward is None
    assert bad.episode["turns"] == meta.get("fail_at", meta.get("crash_at"))
    assert "error" not in good.episode and good.episode["turns"] == 3
    assert r.stats.env_failures == {reason: 1}
    results = EnvScoredOnly().score_groups([prompt("bad"), prompt("good")], [[bad], [good]], str)
    assert results[0][0].status == "failed" and results[0][0].plugin == "env:count"
    assert results[0][0].reason.startswith(f"env_error: {reason}")
    assert results[1][0].ok and results[1][0].plugin == "env:count"


def test_a_reset_failure_fails_the_episode_after_its_first_turn():
    r = runner()
    [[c]] = run(r, [prompt(fail_reset=True)])
    assert c.episode["error"].startswith("bad_prompt") and c.token_ids == TURN and c.episode["turns"] == 1


def test_an_episode_past_its_timeout_fails_without_waiting_for_its_step():
    r = runner(timeout_s=0.3)
    t0 = time.monotonic()
    [[c], [other]] = run(r, [prompt("hang", sleep_s=2.0), prompt("ok")])
    assert time.monotonic() - t0 < 1.5
    assert c.episode["error"].startswith("timeout") and other.env_reward == 1.0
    assert r.stats.env_failures == {"timeout": 1}


def test_tool_failures_are_counted_by_tool():
    r = runner(done_after=2)
    [[c]] = run(r, [prompt(tool_fails=True)])
    assert c.episode["tool_failures_by_tool"] == {"count": 2} and r.stats.tool_failures == {"count": 2}


class EnvScoredOnly(RewardClient):
    """The reward client, its HTTP call replaced by a recorder (what would be sent to the service)."""

    def __init__(self):
        super().__init__(GeneratorConfig(env="count", reward_url="http://127.0.0.1:9"))
        self.sent = []

    def score(self, items):
        from broker.protocol.messages import ResultOut

        self.sent.append(items)
        return [ResultOut(score=0.25, status="ok", plugin="digits") for _ in items]


def test_the_reward_service_scores_only_the_final_answer_of_episodes_the_environment_did_not_score():
    client = EnvScoredOnly()
    scored = Completion(
        [5, 6, 2, 90, 91, 7, 8, 2],
        [0.0] * 8,
        "length",
        trainable=[1, 1, 1, 0, 0, 1, 1, 1],
        answer_ids=[7, 8, 2],
        episode={"turns": 2, "tool_calls": 1},
    )
    by_env = Completion(
        [5, 2],
        [0.0] * 2,
        "stop",
        trainable=[1, 1],
        env_reward=0.5,
        answer_ids=[5, 2],
        episode={"turns": 1, "tool_calls": 0},
    )
    [[a, b]] = client.score_groups([prompt()], [[scored, by_env]], lambda ids: "".join(map(str, ids)))
    [[item]] = client.sent
    assert item.completion == "782" and item.num_tokens == 3 and item.finished is False
    assert a.score == 0.25 and a.details["turns"] == 2.0
    assert b.score == 0.5 and b.plugin == "env:count" and b.details["tool_calls"] == 0.0


def test_single_turn_completions_are_scored_as_before():
    client = EnvScoredOnly()
    c = Completion([4, 7, 2], [0.0] * 3, "stop")
    [[res]] = client.score_groups([prompt()], [[c]], lambda ids: "47")
    [[item]] = client.sent
    assert item.completion == "47" and item.num_tokens == 3 and item.finished and res.details == {}


def test_an_evaluation_run_keeps_one_version_its_own_sampling_and_its_own_counters():
    b = FakeBackend()
    r = runner(b, n=3, versions=[])  # the training hook would fail if it were called
    own = EpisodeStats()
    [group] = r.run(
        [prompt()],
        [[1, 3, 4]],
        seed=0,
        sampling=SamplingConfig(n=1, max_tokens=8, top_k=1),
        between_turns=lambda: 9,
        stats=own,
    )
    assert len(group) == 1 and set(group[0].versions) == {9} and b.calls[0][1].top_k == 1
    assert own.episodes == 1 and r.stats.episodes == 0
    assert r.sampling.n == 3  # the training settings are back


def test_the_episode_counters_reach_prometheus_by_tool_and_reason():
    from generators.metrics import episode_metrics

    r = runner(done_after=2)
    run(r, [prompt("a", tool_fails=True), prompt("b", fail_at=1)])
    fams = {f.name: f for f in episode_metrics(r.stats.snapshot())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert samples[("relay_generator_episodes_total", ())] == 2
    assert samples[("relay_generator_turns_per_episode", ())] == 1.5
    assert samples[("relay_generator_tool_failures_total", (("tool", "count"),))] == 2
    assert samples[("relay_generator_env_failures_total", (("reason", "http_500"),))] == 1
    assert samples[("relay_generator_template_drift_total", ())] == 0


class Hint(Environment):
    """docs/agents.md's guess-the-number environment, in short: "higher" until the last turn."""

    def reset(self, prompt):
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        if self.turns >= 3:
            return StepResult(reply=None, done=True, reward=0.0)
        return StepResult(reply="higher" if self.turns == 1 else "7", done=False, role="user")


def test_a_reply_the_tokenizer_cannot_spell_is_counted_in_the_episode_stats_and_the_sample(caplog):
    """The tiny model's tokenizer spells digits, + = * and the tool markers: "higher" reaches the model as
    <pad>. Counted per reply (a digit reply is not), in the stats the heartbeat, /api/state and /metrics show,
    in the sample's episode info, and logged once with what the model reads instead."""
    from generators.metrics import episode_metrics
    from learner.tiny_model import build_tokenizer

    backend = FakeBackend(turn=[5, 6, EOS])
    backend.tokenizer = build_tokenizer(tools=True)
    backend.encode = lambda text: backend.tokenizer(text)["input_ids"]
    stats = EpisodeStats()
    r = EpisodeRunner(
        backend,
        Hint,
        SamplingConfig(n=2, max_tokens=8),
        EpisodeLimits(4, 48, 30.0),
        lambda: 0,
        threads=4,
        stats=stats,
        env_name="guess",
    )
    with caplog.at_level("WARNING", logger="relay.generator.episodes"):
        (group,) = r.run([prompt("12=")], [[1, 4, 5, 12]], seed=0)
    assert stats.snapshot()["unspellable_replies"] == 2  # one "higher" per episode; "7" is spelled
    assert [c.episode.get("unspellable_replies") for c in group] == [1, 1]
    warned = [m for m in caplog.messages if "cannot spell" in m]
    assert len(warned) == 1 and "'higher'" in warned[0] and "'<pad>'" in warned[0] and "guess" in warned[0]
    fams = {f.name: f for f in episode_metrics(stats.snapshot())}
    assert fams["relay_generator_env_replies_unspellable"].samples[0].value == 2
    from broker.dashboard.state import episode_totals

    assert episode_totals([stats.snapshot(), stats.snapshot()])["unspellable_replies"] == 4


def held_by_another_thread(lock) -> bool:
    """Whether ``lock`` is held (by the calling thread: another one cannot take it)."""
    free = []
    t = threading.Thread(target=lambda: free.append(lock.acquire(blocking=False) and (lock.release() or True)))
    t.start()
    t.join()
    return not free[0]


def test_every_round_samples_under_the_engine_lock():
    """The generator's other users of the engine (its weight updates, the OpenAI endpoint) wait for a round."""
    lock, held = threading.RLock(), []
    b = FakeBackend()
    inner = b.generate
    b.generate = lambda *a, **kw: held.append(held_by_another_thread(lock)) or inner(*a, **kw)
    r = runner(b)
    r.engine_lock = lock
    run(r, [prompt()])
    assert held and all(held)
