"""The SmolLM2 demo's prompts: one-step addition word problems, as JSONL.

    python examples/smollm2-cpu/make_data.py [OUT_DIR]     # default: .cache/smollm2-demo

"Mia has 7 apples and finds 5 more. How many apples does Mia have now?" -> reference "12".
Every (name, item, a, b) combination is listed once, shuffled with a fixed seed; the first
``--test`` rows (128) are the held-out set (test.jsonl), the rest the training set (train.jsonl), so no
held-out question is ever trained on: the demo evaluates the first 32 of them (relay.toml), ``relay
bench peer`` all 128 (benchmarks/peer.py). Standard library only; the same files on every machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

NAMES = ["Mia", "Leo", "Ava", "Sam", "Zoe", "Ben", "Ivy", "Max", "Eva", "Tom", "Lily", "Noah"]
ITEMS = ["apples", "marbles", "stickers", "books", "shells", "coins", "pencils", "cookies", "stamps", "cards"]
TEMPLATE = "{name} has {a} {item} and finds {b} more. How many {item} does {name} have now?"


def rows(seed: int = 0) -> list[dict]:
    combos = list(itertools.product(NAMES, ITEMS, range(2, 21), range(2, 10)))
    random.Random(seed).shuffle(combos)
    return [{"question": TEMPLATE.format(name=n, item=i, a=a, b=b), "answer": str(a + b)} for n, i, a, b in combos]


def write(out: Path, test: int = 128, seed: int = 0) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    data = rows(seed)
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, part in zip(paths, (data[test:], data[:test])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=".cache/smollm2-demo", type=Path)
    ap.add_argument("--test", type=int, default=128, help="held-out rows (the first of the shuffled list)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for p in write(args.out, args.test, args.seed):
        print(p, sum(1 for _ in p.open()), "rows")
