"""TRL's side of ``relay bench peer``: Hugging Face TRL's ``GRPOTrainer`` on the SmolLM2 word problems,
in a process of its own (``python -m benchmarks.peer_trl SPEC.json``), with the settings that
``benchmarks/peer.py`` gives both systems.

It writes, under the spec's ``out``:

- ``steps.jsonl``: one line per optimizer step: its start and end (``time.time()``), the seconds spent
  generating (TRL's ``_generate``: transformers ``generate`` on the training model), scoring and
  preparing the batch (the rest of ``_generate_and_score_completions``: the reward function,
  advantages, any extra forward pass), training (the rest of the step: forward, backward, optimizer),
  saving the checkpoint for the evaluator (not TRL's work: the harness subtracts it), the completion
  tokens trained and the mean reward;
- ``step-<k>/``: the model after step k (every ``save_every`` steps, and step 0 and the last), which
  the shared evaluator (benchmarks/peer_eval.py) scores afterwards;
- ``trl.json``: the resolved GRPOConfig fields that matter and the versions.

TRL runs generation and training one after the other in one process, with every core (``threads``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _reward_function(eos_id: int):
    """TRL reward function: Relay's final_number plugin (format credit 0.2) on each completion; a
    completion is finished when its last token is EOS (TRL's completion ids end at the EOS they hit)."""
    from benchmarks.peer_eval import score

    def final_number(prompts, completions, completion_ids, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        finished = [bool(ids) and ids[-1] == eos_id for ids in completion_ids]
        return score(texts, finished, answer)

    return final_number


def trl_config(spec: dict):
    """The GRPOConfig of the spec: every setting that the two systems share, set explicitly (TRL's own
    defaults differ on several: a linear learning-rate decay, gradient checkpointing, bf16)."""
    from trl import GRPOConfig

    s = spec["settings"]
    micro = s["trl_per_device_batch"]
    completions = s["prompts_per_step"] * s["completions_per_prompt"]
    if completions % micro:
        raise ValueError(f"{completions} completions per step do not split into micro-batches of {micro}")
    return GRPOConfig(
        output_dir=str(Path(spec["out"]) / "trainer"),
        use_cpu=True,
        seed=spec["seed"],
        data_seed=spec["seed"],
        max_steps=spec["steps"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=completions // micro,  # one optimizer step per generation batch
        num_generations=s["completions_per_prompt"],
        max_completion_length=s["max_tokens"],
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=s["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=s["betas"][0],
        adam_beta2=s["betas"][1],
        adam_epsilon=s["adam_eps"],
        weight_decay=0.0,
        max_grad_norm=s["grad_clip"],
        beta=0.0,
        epsilon=s["clip_eps"],
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        bf16=spec["precision"] == "bf16",
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from benchmarks.peer_eval import messages, read_jsonl

    t_launch = time.time()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rows = read_jsonl(Path(spec["train"]))
    data = Dataset.from_list([{"prompt": messages(r["question"]), "answer": r["answer"]} for r in rows])
    config = trl_config(spec)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward_function(tok.eos_token_id),
        args=config,
        train_dataset=data,
        processing_class=tok,
    )

    phase = {"gen_s": 0.0, "prepare_s": 0.0, "tokens": 0, "rewards": []}
    generate, prepare = trainer._generate, trainer._generate_and_score_completions

    def timed_generate(prompts):
        t = time.perf_counter()
        try:
            return generate(prompts)
        finally:
            phase["gen_s"] += time.perf_counter() - t

    def timed_prepare(inputs):
        t, g = time.perf_counter(), phase["gen_s"]
        try:
            batch = prepare(inputs)
        finally:
            phase["prepare_s"] += (time.perf_counter() - t) - (phase["gen_s"] - g)
        phase["tokens"] += int(batch["completion_mask"].sum())
        return batch

    trainer._generate, trainer._generate_and_score_completions = timed_generate, timed_prepare
    log = open(out / "steps.jsonl", "w")

    def save(step: int) -> float:
        t = time.perf_counter()
        trainer.model.save_pretrained(out / f"step-{step}", safe_serialization=True)
        tok.save_pretrained(out / f"step-{step}")
        return time.perf_counter() - t

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.time()
            phase.update(gen_s=0.0, prepare_s=0.0, tokens=0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                phase["rewards"].append(logs["reward"])

        def on_step_end(self, args, state, control, **kw):
            t1 = time.time()
            step = state.global_step
            saved = save(step) if step % spec["save_every"] == 0 or step == spec["steps"] else 0.0
            step_s = t1 - self.t0
            log.write(
                json.dumps(
                    {
                        "step": step,
                        "t_start": self.t0,
                        "t": t1,
                        "step_s": step_s,
                        "gen_s": phase["gen_s"],
                        "prepare_s": phase["prepare_s"],
                        "train_s": step_s - phase["gen_s"] - phase["prepare_s"],
                        "save_s": saved,
                        "tokens": phase["tokens"],
                    }
                )
                + "\n"
            )
            log.flush()

    trainer.add_callback(Record())
    save_s0 = save(0)
    t_train = time.time()
    trainer.train()
    log.close()
    import trl
    import transformers

    keys = (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "steps_per_generation",
        "generation_batch_size",
        "num_generations",
        "max_completion_length",
        "temperature",
        "top_p",
        "top_k",
        "learning_rate",
        "lr_scheduler_type",
        "optim",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "weight_decay",
        "max_grad_norm",
        "beta",
        "epsilon",
        "num_iterations",
        "loss_type",
        "scale_rewards",
        "bf16",
        "gradient_checkpointing",
        "max_steps",
        "seed",
    )
    (out / "trl.json").write_text(
        json.dumps(
            {
                "config": {k: getattr(trainer.args, k) for k in keys},
                "trl": trl.__version__,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "launch": t_launch,
                "train_start": t_train,
                "save0_s": save_s0,
                "rewards": phase["rewards"],
            },
            indent=1,
            default=str,
        )
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1]))
