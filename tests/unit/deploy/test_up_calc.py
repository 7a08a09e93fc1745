"""``relay up --task calc``: the multi-turn task's wiring (its environment, the tiny model's tool
vocabulary, short turns, one-digit operands), below anything the user configures; other tasks unchanged."""

import argparse

from broker.prompts.tasks import TaskConfig, prompt_stream
from deploy.launcher.plan import plan
from deploy.launcher.up import add_up_arguments


def _plan(tmp_path, *argv):
    p = argparse.ArgumentParser()
    add_up_arguments(p)
    return plan(
        p.parse_args(
            ["--runs-dir", str(tmp_path), "--dashboard-port", "0", "--redis-url", "redis://127.0.0.1:1/0", *argv]
        ),
        environ={},
    )


def test_calc_sets_the_environment_the_tool_vocabulary_and_short_turns(tmp_path):
    p = _plan(tmp_path, "--run-id", "a", "--task", "calc")
    g = p["generator"]
    # a turn is at most the one-digit call's 5 tokens: <tool_call> 7 * 8 </tool_call>
    assert g["episodes"]["env"] == "calc" and g["episodes"]["max_turns"] == 3 and g["sampling"]["max_tokens"] == 5
    assert p["learner"]["tiny"]["tools"] is True
    learner = p["learner"]
    assert g["sampling"]["n"] == 32 and learner["batch"]["groups"] == 8
    assert learner["regularization"]["entropy_coef"] == 0.03
    assert learner["optim"]["lr"] == 1e-3 and learner["steps"] == 3000  # docs/agents.md, "Measured"
    assert g["prompts_per_batch"] == 4  # the 2 generators sample a step's 8 groups side by side
    assert p["broker"]["task"]["min_digits"] == p["broker"]["task"]["max_digits"] == 1
    assert p["reward"]["task_plugins"]["calc"] == "digits" and p["reward"]["task_plugins"]["copy"] == "digits"
    # the user's settings win over the task's defaults
    q = _plan(
        tmp_path,
        "--run-id",
        "b",
        "--task",
        "calc",
        "--set",
        "generator.episodes.max_turns=5",
        "--set",
        "generator.sampling.max_tokens=12",
        "--set",
        "broker.task.max_digits=2",
    )
    assert q["generator"]["episodes"]["max_turns"] == 5 and q["generator"]["sampling"]["max_tokens"] == 12
    assert q["broker"]["task"]["max_digits"] == 2 and q["broker"]["task"]["min_digits"] == 1
    q = _plan(tmp_path, "--run-id", "c", "--task", "calc", "--steps", "50", "--set", "learner.optim.lr=0.001")
    assert q["learner"]["steps"] == 50 and q["learner"]["optim"]["lr"] == 1e-3


def test_calc_turn_budget_follows_the_operands_and_the_generators_share_a_step(tmp_path):
    # two-digit operands: the call <tool_call> 12 * 34 </tool_call> is 7 tokens, and so is a turn
    p = _plan(tmp_path, "--run-id", "a", "--task", "calc", "--set", "broker.task.max_digits=2")
    assert p["generator"]["sampling"]["max_tokens"] == 7
    # one generator claims a whole step's groups; three claim 3 each (8 groups)
    assert (
        _plan(tmp_path, "--run-id", "b", "--task", "calc", "--generators", "1")["generator"]["prompts_per_batch"] == 8
    )
    assert (
        _plan(tmp_path, "--run-id", "c", "--task", "calc", "--generators", "3")["generator"]["prompts_per_batch"] == 3
    )
    q = _plan(tmp_path, "--run-id", "d", "--task", "calc", "--set", "learner.batch.groups=16")
    assert q["generator"]["prompts_per_batch"] == 8
    r = _plan(tmp_path, "--run-id", "e", "--task", "calc", "--set", "generator.prompts_per_batch=2")
    assert r["generator"]["prompts_per_batch"] == 2


def test_single_turn_tasks_are_planned_as_before(tmp_path):
    p = _plan(tmp_path, "--run-id", "a", "--task", "copy")
    assert "episodes" not in p["generator"] and "sampling" not in p["generator"]
    assert "tiny" not in p["learner"] and "task_plugins" not in p["reward"]
    assert p["broker"]["task"] == {"name": "copy", "seed": 0}


def test_calc_prompts_are_products_with_their_reference():
    prompts = prompt_stream(TaskConfig(name="calc", min_digits=1, max_digits=1, seed=3))
    for _ in range(50):
        p = next(prompts)
        a, b = p.text.removesuffix("=").split("*")
        assert p.task == "calc" and len(a) == len(b) == 1 and p.reference == str(int(a) * int(b))
