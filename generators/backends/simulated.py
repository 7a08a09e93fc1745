"""The ``simulated`` backend: an engine whose speed is a setting, for benchmarks and tests of the
pipeline around it (``relay bench overlap``). It stands in for a GPU engine on a machine without one.

``generate`` returns valid completions without running a model: token ids drawn uniformly from the
snapshot's vocabulary (special tokens excluded; EOS ends a completion early with probability
``eos_prob`` per token), and the exact log-prob of each draw under that uniform distribution, so the
broker and the learner accept them as they would a real engine's. It *sleeps* like an engine that
decodes all rows in lockstep: ``per_token_latency_s`` × the rows still running, at every decode step
(a compute-bound engine spends time per generated token). ``load`` and ``update_weights`` read every
file of the snapshot (the same I/O as a real load) and then sleep ``load_s``.
"""

from __future__ import annotations

import json
import os
import math
import time
from pathlib import Path

import numpy as np

from generators.backends.base import Completion, StepHook
from generators.config import SamplingConfig, SimulatedBackendConfig


class SimulatedBackend:
    name = "simulated"
    supports_in_flight = (
        SimulatedBackendConfig.supports_in_flight
    )  # declared with its config (the validator reads it there)

    def __init__(self, cfg: SimulatedBackendConfig):
        self.cfg = cfg
        self.tokenizer = None
        self.eos_token_id = -1
        self._allowed: np.ndarray | None = None

    def _read(self, path: str) -> dict:
        cfg = json.loads((Path(path) / "config.json").read_text())
        for f in sorted(Path(path).iterdir()):
            if f.is_file():
                f.read_bytes()  # the same bytes a real engine would read
        time.sleep(self.cfg.load_s)
        return cfg

    def load(self, path: str) -> None:
        from tokenizers import Tokenizer

        cfg = self._read(path)
        self.tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        self.eos_token_id = int(cfg["eos_token_id"])
        special = {cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} - {None}
        self._allowed = np.array([i for i in range(int(cfg["vocab_size"])) if i not in special], dtype=np.int64)
        self._vocab_size = int(cfg["vocab_size"])

    def engine_info(self) -> dict:
        return {"pid": os.getpid(), "engine_id": id(self)}

    def update_weights(self, path: str) -> None:
        cfg = self._read(path)
        if int(cfg["vocab_size"]) != self._vocab_size:
            raise ValueError(
                f"the snapshot's vocab_size {cfg['vocab_size']} differs from the served {self._vocab_size}"
            )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, on_step: StepHook | None = None
    ) -> list[list[Completion]]:
        rng = np.random.default_rng(seed)
        rows = len(prompts) * sampling.n
        k = len(self._allowed)
        p_eos = self.cfg.eos_prob
        lp_token, lp_eos = math.log((1 - p_eos) / k), math.log(p_eos) if p_eos > 0 else -math.inf
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logps: list[list[float]] = [[] for _ in range(rows)]
        versions: list[list[int]] = [[] for _ in range(rows)]
        running = list(range(rows))
        for _ in range(sampling.max_tokens):
            if not running:
                break
            version = on_step() if on_step is not None else -1  # may apply new weights right here
            time.sleep(self.cfg.per_token_latency_s * len(running))
            stop = rng.random(len(running)) < p_eos
            draws = self._allowed[rng.integers(0, k, len(running))]
            still = []
            for i, s, tok in zip(running, stop, draws):
                versions[i].append(version)
                if s:
                    tokens[i].append(self.eos_token_id)
                    logps[i].append(lp_eos)
                else:
                    tokens[i].append(int(tok))
                    logps[i].append(lp_token)
                    still.append(i)
            running = still
        out: list[list[Completion]] = []
        for i in range(rows):
            done = tokens[i][-1] == self.eos_token_id
            if i % sampling.n == 0:
                out.append([])
            out[-1].append(
                Completion(
                    tokens[i], logps[i], "stop" if done else "length", versions[i] if on_step is not None else None
                )
            )
        return out
