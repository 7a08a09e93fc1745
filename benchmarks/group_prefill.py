"""The torch backend's group prefill against per-row prefill (not a `relay bench` row; run by hand):

    python -m benchmarks.group_prefill MODEL_DIR [--prompts 8] [--n 8] [--max-tokens 64] [--repeats 3]

``TorchBackend.generate(prompts, n=8)`` (one prefill per prompt, its KV cache copied to the n samples)
against the same call on each prompt repeated n times with n=1 (the n prefills the backend did
before), alternating, one torch thread; prints the median seconds of each and their ratio. Prompts:
the SmolLM2 demo's questions with its system prompt and the model's chat template
(examples/smollm2-cpu/make_data.py)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "smollm2-cpu"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    from generators.backends.torch import TorchBackend
    from generators.config import SamplingConfig, TorchBackendConfig
    from make_data import rows  # the demo's questions

    torch.set_num_threads(1)
    b = TorchBackend(TorchBackendConfig())
    b.load(args.model)
    system = (
        "You are a careful math tutor. Solve the problem in a few short steps, then write the final answer "
        "on its own line as 'Answer: <number>'."
    )
    prompts = [
        b.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": r["question"]}],
            add_generation_prompt=True,
            tokenize=True,
        )["input_ids"]
        for r in rows()[: args.prompts]
    ]
    s = SamplingConfig(n=args.n, temperature=0.7, max_tokens=args.max_tokens)
    grouped, repeated = [], []
    for k in range(args.repeats):
        t = time.perf_counter()
        b.generate(prompts, s, seed=k)
        grouped.append(time.perf_counter() - t)
        t = time.perf_counter()
        b.generate([p for p in prompts for _ in range(args.n)], s.model_copy(update={"n": 1}), seed=k)
        repeated.append(time.perf_counter() - t)
    g, r = statistics.median(grouped), statistics.median(repeated)
    print(
        json.dumps(
            {
                "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
                "grouped_s": round(g, 2),
                "per_row_s": round(r, 2),
                "ratio": round(g / r, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
