"""The one evaluator of ``relay bench peer``: greedy pass@1 of a saved Hugging Face model folder on
held-out word problems, the same code for Relay's versions and TRL's checkpoints.

Each question is rendered with the tokenizer's chat template (the system prompt of
examples/smollm2-cpu/relay.toml, ``add_generation_prompt``), answered greedily by transformers'
``generate`` (left-padded batches, at most ``max_tokens`` new tokens, stopping at EOS) and scored by
Relay's ``final_number`` plugin: correct means the full score (the right tagged number), as the
demo's ``threshold = 1.0``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem in a few short steps, then write the final answer "
    "on its own line as 'Answer: <number>'."
)


def read_jsonl(path: Path, n: int | None = None) -> list[dict]:
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return rows[:n] if n else rows


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def score(completions: list[str], finished: list[bool], answers: list[str]) -> list[float]:
    """Relay's final_number plugin (format credit 0.2, as in training) on each completion."""
    from reward_service.builtin.basic import FinalNumber
    from reward_service.plugins import Item

    plugin = FinalNumber({"format_score": 0.2})
    items = [Item(prompt="", completion=c, reference=a, finished=f) for c, f, a in zip(completions, finished, answers)]
    return [r.score for r in asyncio.run(plugin.score(items))]


def pass_at_1(model_dir: Path, rows: list[dict], max_tokens: int = 64, batch: int = 32) -> dict:
    """Greedy pass@1 of the model in ``model_dir`` on ``rows`` ({question, answer}); the mean completion
    length and the seconds it took."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts, finished, lengths = [], [], []
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            part = rows[i : i + batch]
            prompts = [
                tok.apply_chat_template(messages(r["question"]), tokenize=False, add_generation_prompt=True)
                for r in part
            ]
            enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                **enc,
                max_new_tokens=max_tokens,
                do_sample=False,
                top_k=None,
                top_p=None,
                temperature=None,
                pad_token_id=tok.pad_token_id,
            )
            for seq in out[:, enc["input_ids"].shape[1] :].tolist():
                ends = [j for j, t in enumerate(seq) if t == tok.eos_token_id]
                body = seq[: ends[0]] if ends else seq
                texts.append(tok.decode(body, skip_special_tokens=True))
                finished.append(bool(ends))
                lengths.append(len(body) + bool(ends))
    scores = score(texts, finished, [r["answer"] for r in rows])
    correct = [s is not None and s >= 1.0 for s in scores]
    return {
        "pass_at_1": sum(correct) / len(rows),
        "n": len(rows),
        "mean_tokens": sum(lengths) / len(rows),
        "eval_s": round(time.perf_counter() - t0, 1),
        "example": texts[0],
    }
