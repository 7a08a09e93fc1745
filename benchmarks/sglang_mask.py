"""generator/sglang_mask_*: what SGLang's sampling mask costs the sglang backend (``relay bench --sglang generator``).

With top-k or top-p the backend asks SGLang for ``return_sampling_mask`` (``selected`` mode) to get each sampled
token's log-prob within the set SGLang's sampler kept (generators/backends/sglang.py). SGLang then sorts the
probabilities, packs up to ``--sampling-mask-max-tokens`` token ids per row at every decode step and returns the
kept ids of every token. The value: completion tokens/s of ``SGLangBackend.generate`` on a server launched as a
generator with that sampling launches it (``GeneratorConfig``: the mask cap is top_k with top-k, the vocabulary
with top-p). The raw baseline: the same batch and sampling as one plain ``/generate`` to that server with
``return_logprob`` and no mask (what a caller that does not train on the log-probs would send; top-p without
top_k). Both alternate in rounds on one server; each figure is the median round.

The model: SmolLM2-135M-Instruct (a real vocabulary, 49,152 tokens; built when missing) at full size, the
tiny model with ``--quick``; 8 chat prompts × n 4, 32 new tokens each (EOS ignored: every round is the same
number of tokens). ``details`` also has the answer's bytes per token, with and without the mask.

``RELAY_BENCH_MASK_CAP=N`` launches both servers with ``--sampling-mask-max-tokens N`` instead (e.g. the
vocabulary's size for top-k: what a launched server had before the cap followed ``top_k``).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from benchmarks.common import row, skipped

TARGET = 0.8
SAMPLINGS = {"top_k": {"top_k": 50}, "top_p": {"top_p": 0.95}}
QUESTIONS = [
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "What is 12 times 7?",
    "A train travels 60 km in one hour. How far does it go in 3 hours?",
    "Write one sentence about the sea.",
    "Sara had 20 coins and gave away 8. How many are left?",
    "Name three colours.",
    "If a box holds 6 eggs, how many eggs are in 4 boxes?",
    "What is the capital of France?",
]


def _prompts(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.chat_template:
        chat = [[{"role": "user", "content": q}] for q in QUESTIONS]
        return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chat]
    return [tok(f"{i * 37 % 1000}=")["input_ids"] for i in range(len(QUESTIONS))]  # the tiny model's digits


def _measure(python: str, path: Path, name: str, extra: dict, rounds: int, max_tokens: int) -> dict:
    from generators.config import GeneratorConfig

    launch = {"python": python, "sampling_mask_max_tokens": int(os.environ.get("RELAY_BENCH_MASK_CAP", 0))}
    cfg = GeneratorConfig(
        backend={"type": "sglang", "launch": launch},
        sampling={"n": 4, "temperature": 1.0, "max_tokens": max_tokens, **extra},
    )
    backend = cfg.backend.build()
    try:
        backend.load(str(path))
        sizes = []  # bytes of each /generate answer
        backend.http.event_hooks["response"] = [lambda r: r.url.path == "/generate" and sizes.append(len(r.read()))]
        prompts = _prompts(path)
        params = {"temperature": 1.0, "max_new_tokens": max_tokens, "ignore_eos": True, **extra}
        raw = {"input_ids": [p for p in prompts for _ in range(cfg.sampling.n)], "return_logprob": True}
        raw["sampling_params"] = params
        sampling = cfg.sampling.model_copy(update={"max_tokens": max_tokens})
        backend.generate(prompts[:2], sampling.model_copy(update={"n": 2, "max_tokens": 4}), seed=0)  # warm-up
        ours, theirs, ours_bytes, theirs_bytes = [], [], [], []
        for r in range(rounds):
            sizes.clear()
            t0 = time.perf_counter()
            tokens = sum(len(c.token_ids) for g in backend.generate(prompts, sampling, seed=r) for c in g)
            t1 = time.perf_counter()
            answers = backend.http.post("/generate", json=raw).raise_for_status().json()
            t2 = time.perf_counter()
            raw_tokens = sum(len(a["output_ids"]) for a in answers)
            ours.append(tokens / (t1 - t0))
            theirs.append(raw_tokens / (t2 - t1))
            ours_bytes.append(sizes[0] / tokens)
            theirs_bytes.append(sizes[1] / raw_tokens)
        # the kept sets' sizes, from one answer of the backend's own request
        (a,) = backend._request(prompts[:1], sampling, max_tokens)
        kept = [len(m) for m in a["meta_info"]["output_token_sampling_mask"]]
        cap = cfg.backend.launch.sampling_mask_max_tokens or backend.vocab_size
    finally:
        backend.close()
    return row(
        f"generator/sglang_mask_{name}",
        statistics.median(ours),
        statistics.median(theirs),
        "tokens/s",
        TARGET,
        "higher",
        {
            "sampling": extra,
            "mask_cap": cap,
            "vocab": backend.vocab_size,
            "rows": len(raw["input_ids"]),
            "max_tokens": max_tokens,
            "kept_median": statistics.median(kept) if kept else None,
            "kept_max": max(kept) if kept else None,
            "answer_bytes_per_token": statistics.median(ours_bytes),
            "raw_answer_bytes_per_token": statistics.median(theirs_bytes),
            "backend_tokens_per_s": ours,
            "raw_tokens_per_s": theirs,
        },
    )


def run(quick: bool, python: str | None) -> list[dict]:
    names = [f"generator/sglang_mask_{n}" for n in SAMPLINGS]
    if python is None:
        why = "SGLang's own environment is not built (make sglang-env)"
        return [skipped(n, why, "tokens/s", TARGET, "higher") for n in names]
    if quick:
        import tempfile

        from learner.tiny_model import build_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="relay-bench-mask-")
        path = build_tiny_model(Path(tmp.name) / "model", vllm_compatible=True)
    else:
        from benchmarks.learner_memory import smollm2

        path = smollm2()
        if isinstance(path, str):
            return [skipped(n, path, "tokens/s", TARGET, "higher") for n in names]
    rounds, max_tokens = (1, 8) if quick else (3, 32)
    return [_measure(python, path, n, extra, rounds, max_tokens) for n, extra in SAMPLINGS.items()]
