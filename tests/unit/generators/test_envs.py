"""The environment registry, the tool-calling environment and the calc environment's reward."""

import os
import shutil
import time

import pytest

from broker.protocol.messages import PromptEntry
from generators.envs.base import Environment, StepResult
from generators.envs.calc import calc_reward
from generators.envs.registry import UnknownEnvError, build_env, register_env
from generators.tool_calls import parse_tool_calls
from generators.envs.tools import Tool


def episode(env, prompt: PromptEntry, turns: list[str]) -> list[StepResult]:
    env.reset(prompt)
    out = []
    for t in turns:
        r = env.step(t)
        out.append(r)
        if r.done:
            break
    env.close()
    return out


# ---- registry ----------------------------------------------------------------------------------


def test_unknown_env_lists_the_valid_names():
    with pytest.raises(UnknownEnvError) as e:
        build_env("nope")
    assert "'nope'" in str(e.value) and "calc" in str(e.value) and "remote" in str(e.value) and "tools" in str(e.value)


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match=r"max_turns"):
        build_env("calc", {"max_turns": 0})
    with pytest.raises(ValueError, match=r"unknown tools \['shell'\]"):
        build_env("tools", {"tools": ["shell"]})
    with pytest.raises(ValueError, match=r"tuns"):
        build_env("calc", {"tuns": 3})
    with pytest.raises(ValueError, match=r"url"):
        build_env("remote", {})


def test_register_env_and_one_instance_per_episode():
    @register_env("test_echo")
    class Echo(Environment):
        def reset(self, prompt):
            self.n = 0

        def step(self, turn):
            self.n += 1
            return StepResult(reply=turn, done=self.n >= 2, role="user")

    factory = build_env("test_echo", {})
    a, b = factory(), factory()
    assert a is not b and isinstance(a, Echo) and factory.name == "test_echo" and factory.stats() == {}
    assert [r.done for r in episode(a, PromptEntry("x"), ["1", "2", "3"])] == [False, True]
    with pytest.raises(ValueError, match="already registered"):
        register_env("calc")(Echo)


# ---- tools env -----------------------------------------------------------------------------------


def test_tool_env_runs_calls_then_ends_on_an_answer():
    factory = build_env("tools", {"tools": ["calculator"]})
    env = factory()
    env.reset(PromptEntry("what is 7*8 plus 1?"))
    r = env.step(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "7*8"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>{oops</tool_call>'
    )
    assert not r.done and r.role == "tool" and r.reward is None
    assert r.reply.split("\n")[0] == "56" and r.reply.split("\n")[1].startswith("error: division_by_zero")
    assert [(c.name, c.ok, c.error.split(":")[0]) for c in r.tool_calls] == [
        ("calculator", True, ""),
        ("calculator", False, "division_by_zero"),
        ("unknown", False, "unknown_tool"),
        ("calculator", False, "bad_json"),
    ]
    final = env.step("57")
    assert final.done and final.reply is None and final.reward is None
    s = factory.stats()
    assert s["tool_calls"] == {"calculator": 3, "unknown": 1}
    assert s["tool_failures"] == {"calculator:division_by_zero": 1, "unknown:unknown_tool": 1, "calculator:bad_json": 1}
    assert env.tool_specs() == factory.tool_specs()
    assert [t["function"]["name"] for t in factory.tool_specs()] == ["calculator"]
    assert factory.tool_specs()[0]["function"]["parameters"]["required"] == ["expression"]
    factory.close()


def test_tool_env_limits_calls_per_turn():
    env = build_env("tools", {"tools": ["calculator"], "max_calls_per_turn": 2})()
    env.reset(PromptEntry(""))
    r = env.step("<tool_call>1+1</tool_call>" * 3)
    assert r.reply.split("\n")[:2] == ["2", "2"] and r.tool_calls[2].error == "too_many_calls"


def test_a_slow_tool_times_out_without_holding_the_others():
    factory = build_env("tools", {"tools": ["calculator"]})
    slow = Tool(
        "slow",
        "sleeps",
        {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
        lambda a: (time.sleep(float(a["s"])), "woke")[1],
        timeout_s=0.3,
    )
    factory.shared.tools["slow"] = slow
    env = factory()
    env.reset(PromptEntry(""))
    t0 = time.monotonic()
    r = env.step(
        '<tool_call>{"name": "slow", "arguments": {"s": "3"}}</tool_call>'
        '<tool_call>{"name": "slow", "arguments": {"s": "0.01"}}</tool_call><tool_call>2*3</tool_call>'
    )
    assert time.monotonic() - t0 < 2.0  # concurrent, bounded by the timeout (0.3 s + a 0.5 s grace), not 3 s
    assert r.reply.split("\n")[1:] == ["woke", "6"] and r.tool_calls[0].error == "timeout"
    assert factory.stats()["tool_failures"] == {"slow:timeout": 1}
    factory.close()


NO_SANDBOX = os.geteuid() != 0 or shutil.which("unshare") is None


def test_python_tool_runs_in_the_sandbox():
    factory = build_env("tools", {"tools": ["python"], "python_isolation": "rlimits", "timeout_s": {"python": 2}})
    env = factory()
    env.reset(PromptEntry(""))
    r = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>')
    [call] = r.tool_calls
    if NO_SANDBOX or call.error.startswith("sandbox_unavailable"):
        pytest.skip(f"the code sandbox does not run here (needs root/CAP_SYS_ADMIN for namespaces): {call.error}")
    assert call.ok and r.reply.strip() == "42"
    r = env.step(
        '<tool_call>{"name": "python", "arguments": {"code": "import socket; '
        'socket.create_connection((\\"1.1.1.1\\", 80), timeout=1)"}}</tool_call>'
    )
    assert not r.tool_calls[0].ok and r.tool_calls[0].error.startswith("exit_status") and "OSError" in r.reply
    t0 = time.monotonic()
    r = env.step(
        '<tool_call>{"name": "python", "arguments": {"code": "print(1, flush=True)\\nwhile True: pass"}}</tool_call>'
    )
    assert time.monotonic() - t0 < 4 and r.tool_calls[0].error.startswith("timeout") and "ran over 2" in r.reply
    assert factory.stats()["tool_failures"] == {"python:exit_status": 1, "python:timeout": 1}
    factory.close()


def test_python_tool_without_a_sandbox_fails_visibly(monkeypatch):
    from reward_service.builtin import sandbox

    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)  # as on a machine without util-linux
    factory = build_env("tools", {"tools": ["python"], "python_isolation": "rlimits"})
    env = factory()
    env.reset(PromptEntry(""))
    r = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    assert r.reply.startswith("error: sandbox_unavailable") and not r.done
    assert factory.stats()["tool_failures"] == {"python:sandbox_unavailable": 1}


# ---- calc ----------------------------------------------------------------------------------------

P = PromptEntry("7*8=", reference="56", task="calc")


def test_calc_perfect_episode_scores_one():
    env = build_env("calc")()
    r1, r2 = episode(env, P, ["<tool_call>7*8</tool_call>", "56"])
    assert (r1.reply, r1.role, r1.done) == ("56", "tool", False) and r1.tool_calls[0].ok
    assert r2.done and r2.reward == 1.0
    assert r2.info == {"tool": 1.0, "expression": 1.0, "operands": 1.0, "answer": 1.0, "turns": 2}


def test_calc_hermes_form_is_accepted():
    env = build_env("calc")()
    js = '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>'
    assert episode(env, P, [js, "56"])[-1].reward == 1.0


def test_calc_answering_without_the_tool_scores_zero():
    env = build_env("calc")()
    [r] = episode(env, P, ["56"])
    assert r.done and r.reward == 0.0 and r.info["turns"] == 1


def test_calc_partial_credit():
    def approx(x):  # rewards are rounded to 6 decimals
        return pytest.approx(x, abs=1e-6)

    def reward(call, answer):
        return episode(build_env("calc")(), P, [f"<tool_call>{call}</tool_call>", answer])[-1].reward

    # 2 of 3 characters, one operand of two, the tool's 21 read back: 0.1 + 0.5 * 2/3 + 0.4 * (1/2)² * 1
    r1, r2 = episode(build_env("calc")(), P, ["<tool_call>7*3</tool_call>", "21"])
    assert r1.reply == "21" and r2.reward == approx(0.1 + 0.5 * 2 / 3 + 0.1)
    assert r2.info == {"tool": 1.0, "expression": approx(2 / 3), "operands": 0.5, "answer": 1.0, "turns": 2}
    # no operand right: the call's credit and its operator, whatever the answer (the tool's 54, or the true
    # 56 remembered rather than read): a call that ignores the prompt earns no answer credit
    assert reward("9*6", "54") == approx(0.1 + 0.5 / 3) == reward("9*6", "56") == reward("4*4", "16")
    # another operator: the operands' characters count, the answer does not
    assert reward("7+8", "15") == approx(0.1 + 0.5 * 2 / 3)
    # half an expression, a bare number: readable calls, but not an operation the tool computed
    assert reward("7*", "56") == approx(0.05 + 0.5 * 2 / 3) and reward("975", "975") == approx(0.05)
    # right expression, no answer digit right
    assert reward("7*8", "3") == approx(0.6)
    # ...beats one operand right with a second that makes the answer trivial, read back right (0.53; 0.63
    # when the answer's credit was weighted by o, not o², and a run settled on d*0 answered 0)
    trivial = reward("7*0", "0")
    assert trivial == approx(0.1 + 0.5 * 2 / 3 + 0.4 / 4) and trivial < reward("7*8", "3")
    assert reward("7*1", "7") < reward("7*8", "3")
    # an unreadable call counts as calling the tool but earns no tool or expression credit
    r = episode(build_env("calc")(), P, ["<tool_call>{7*8</tool_call>", "56"])
    assert r[0].tool_calls[0].error == "bad_json" and r[-1].reward == 0.0


def test_calc_ends_after_max_turns():
    env = build_env("calc", {"max_turns": 3})()
    rs = episode(env, P, ["<tool_call>7*8</tool_call>"] * 5)
    assert [r.done for r in rs] == [False, False, True]
    assert rs[-1].reward == pytest.approx(0.6) and rs[-1].info["out_of_turns"] == 1


def test_calc_reward_is_in_range_and_random_turns_score_low():
    import random

    rng = random.Random(0)
    alphabet = list("0123456789+*-=") + ["<tool_call>", "</tool_call>"]
    rewards = []
    for _ in range(300):
        turns = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(3)]
        env = build_env("calc")()
        rs = episode(env, P, turns)
        rewards.append(rs[-1].reward if rs[-1].done else 0.0)
    assert all(0.0 <= r <= 1.0 for r in rewards) and sum(rewards) / len(rewards) <= 0.2


def test_calc_reward_function():
    calls = parse_tool_calls("<tool_call>7*8</tool_call>")
    assert calc_reward("7*8", calls, True, "56", "56") == (
        1.0,
        {"tool": 1.0, "expression": 1.0, "operands": 1.0, "answer": 1.0},
    )
    assert calc_reward("7*8", [], False, "56", None)[0] == 0.0
    assert calc_reward("7*8", calls, True, None, "56")[0] == pytest.approx(0.6)
    assert calc_reward("7*8", calls, True, "560", "56")[0] == pytest.approx(0.6 + 0.4 * 2 / 3)
    assert calc_reward("7*8", calls, True, "56", None)[0] == pytest.approx(0.55)  # the tool gave no number


def test_calc_evaluation_counts_only_the_exact_call_and_the_whole_answer():
    """Why an evaluation round can report pass@1 0 while the training reward is 0.8 (docs/agents.md, Measured):
    pass@1 counts an episode correct at the round's threshold, 1.0, which only the exact call with the tool's
    whole result read back reaches; the exact call with one digit of the answer (``5`` for 56, ``89`` for 81, ``40``
    for 4) scores 0.8, however many prompts it answers that way."""
    from broker.prompts.evals import summarize_round
    from broker.protocol.messages import EvalCompletion, EvalResult, EvalRound

    make = build_env("calc", {})

    def greedy(prompt: str, answer: str) -> EvalResult:
        r = episode(make(), PromptEntry(prompt, "", "calc"), [f"<tool_call>{prompt[:-1]}</tool_call>", answer])[-1]
        assert r.done
        return EvalResult(version=600, greedy=EvalCompletion(reward=r.reward, length=12, finish_reason="stop"))

    one_digit = {0: greedy("7*8=", "5"), 1: greedy("9*9=", "89"), 2: greedy("2*2=", "40")}
    assert [res.greedy.reward for res in one_digit.values()] == pytest.approx([0.8, 0.8, 0.8])
    s = summarize_round(EvalRound(version=600, prompts=3), one_digit)
    assert s["pass@1"] == 0.0 and s["mean_reward"] == pytest.approx(0.8)
    whole = {0: greedy("7*8=", "56"), 1: greedy("9*9=", "89"), 2: greedy("2*2=", "4")}
    s = summarize_round(EvalRound(version=600, prompts=3), whole)
    assert s["pass@1"] == pytest.approx(2 / 3)


def test_calc_without_reference_uses_the_true_value():
    env = build_env("calc")()
    assert episode(env, PromptEntry("12+30="), ["<tool_call>12+30</tool_call>", "42"])[-1].reward == 1.0


# ---- entry points and the remote contract's replies ------------------------------------------------


class EntryPointEnv(Environment):
    """Registered in a test through a real ``relay.envs`` entry point."""

    def reset(self, prompt):
        pass

    def step(self, turn):
        return StepResult(reply=None, done=True, reward=0.5)


def test_relay_envs_entry_points_register(monkeypatch):
    from importlib.metadata import EntryPoint

    from broker.runtime import registry as loader
    from generators.envs import registry

    eps = [EntryPoint("ep_env", "tests.unit.generators.test_envs:EntryPointEnv", "relay.envs")]
    monkeypatch.setattr(loader, "entry_points", lambda group: eps if group == "relay.envs" else [])
    assert registry.load_entry_point_envs() == ["ep_env"]
    env = build_env("ep_env")()
    assert isinstance(env, EntryPointEnv) and env.step("x").reward == 0.5
    bad = [EntryPoint("ep_bad", "generators.tool_calls:parse_tool_calls", "relay.envs")]
    monkeypatch.setattr(loader, "entry_points", lambda group: bad)
    with pytest.raises(TypeError, match="is not a subclass of Environment"):
        registry.load_entry_point_envs()


def test_remote_step_replies_are_checked():
    from generators.envs.remote import parse_step_reply

    ok = parse_step_reply({"reply": "56", "done": False, "tool_calls": [{"name": "calculator", "ok": True}]})
    assert (ok.reply, ok.role, ok.reward, ok.tool_calls[0].name) == ("56", "tool", None, "calculator")
    end = parse_step_reply({"reply": None, "done": True, "reward": 1, "role": "user", "info": {"k": 1}})
    assert (end.done, end.reward, end.role, end.info) == (True, 1.0, "user", {"k": 1})
    assert parse_step_reply({"reply": "x", "done": False, "reward": 0.3}).reward is None  # only with done
    for bad, what in [
        ([], "object"),
        ({"reply": "x"}, "done"),
        ({"done": False}, "required"),
        ({"done": True, "reward": "1"}, "finite"),
        ({"done": True, "reward": float("nan")}, "finite"),
        ({"done": True, "role": "system"}, "role"),
        ({"done": True, "tool_calls": [{"name": 1}]}, "tool_calls"),
        ({"done": True, "info": []}, "info"),
        ({"done": "yes"}, "done"),
        ({"done": True, "reward": 3e38}, r"outside \[-1e\+06, 1e\+06\]"),
    ]:
        with pytest.raises(ValueError, match=what):
            parse_step_reply(bad)


def test_the_python_example_of_docs_agents_md_works():
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[3] / "docs" / "agents.md").read_text()
    src = re.search(r"```python\n(.*?)```", doc, re.DOTALL).group(1)
    ns = {"__name__": "docs_agents_example"}
    exec(compile(src, "docs/agents.md", "exec"), ns)
    register_env("guess")(ns["Guess"])  # what its package's entry point does (tests/integration/test_agents_docs.py)
    env = build_env("guess", {"max_turns": 4})()
    rs = episode(env, PromptEntry("guess", reference="42"), ["10", "50", "42"])
    assert [(r.reply, r.role, r.done, r.reward) for r in rs] == [
        ("higher", "user", False, None),
        ("lower", "user", False, None),
        (None, "tool", True, 1.0),
    ]
