"""generator: completion tokens/s of a ``relay generator`` process (claiming prompts from the broker's
stream, sampling, one reward call per batch, sending each group to the broker and waiting for its
ack) against its raw engine in this process on the same prompts with the same sampling: for the torch
backend its batched KV-cache sampler (``TorchBackend.generate``), for vLLM ``LLM.generate``, for SGLang
(``--sglang``) a raw ``/generate`` of the same batch to an SGLang server (started from SGLang's own
environment, as the generator starts its own). With ``--sglang`` also ``generator/sglang_mask_top_k`` and
``_top_p``: what SGLang's sampling mask costs (benchmarks/sglang_mask.py).

The service's rate comes from two of its heartbeats (each sent at the end of a batch: tokens so far
and the time), after a warm-up batch. The raw engine runs before and after the service (the service
stack stopped meanwhile), so both see comparable machine load; its figure is the mean of the two.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import Stack, bench_model, row, skipped, torch_threads, wait_until

TARGET = 0.9


def vllm_missing() -> str | None:
    """Why the vLLM row cannot run here, or None when it can."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed in this environment"
    return None


def sglang_python() -> str | None:
    """SGLang's own interpreter (RELAY_SGLANG_PYTHON, else .cache/sglang-venv of this checkout), None without it."""
    given = os.environ.get("RELAY_SGLANG_PYTHON") or str(
        Path(__file__).resolve().parents[1] / ".cache/sglang-venv/bin/python"
    )
    return given if Path(given).is_file() else None


def backend_config(kind: str) -> dict:
    if kind == "torch":
        return {"type": "torch"}
    if kind == "sglang":
        return {"type": "sglang", "launch": {"python": sglang_python()}}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM on CPU fails at start-up without it
    return {"type": "vllm"}


def _raw(kind: str, path: str, prompts: list[str], batch: int, sampling, seconds: float) -> tuple[float, int]:
    """(tokens/s, batches) of the raw engine over at least ``seconds`` (and at least 2 batches)."""
    from generators.config import GeneratorConfig

    backend = GeneratorConfig.model_validate({"backend": backend_config(kind)}).backend.build()
    backend.load(path)
    batches = [[backend.encode(t) for t in prompts[i : i + batch]] for i in range(0, len(prompts), batch)]
    if kind == "vllm":
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        def gen(ids, seed):
            params = SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=sampling.max_tokens,
                logprobs=0,
                seed=seed,
            )
            outs = backend.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
            return sum(len(o.token_ids) for r in outs for o in r.outputs)
    elif kind == "sglang":

        def gen(ids, seed):
            params = {"temperature": sampling.temperature, "max_new_tokens": sampling.max_tokens}
            params["stop_token_ids"] = [backend.eos_token_id]
            rows = [p for p in ids for _ in range(sampling.n)]
            body = {"input_ids": rows, "sampling_params": params, "return_logprob": True}
            out = backend.http.post("/generate", json=body).raise_for_status().json()
            return sum(len(a["output_ids"]) for a in out)
    else:

        def gen(ids, seed):
            return sum(len(c.token_ids) for g in backend.generate(ids, sampling, seed) for c in g)

    try:
        gen(batches[0], 0)  # warm-up
        tokens, k, t0 = 0, 0, time.perf_counter()
        while k < 2 or time.perf_counter() - t0 < seconds:
            tokens += gen(batches[k % len(batches)], k + 1)
            k += 1
        return tokens / (time.perf_counter() - t0), k
    finally:
        if hasattr(backend, "close"):
            backend.close()  # the SGLang server it started


def measure(kind: str, quick: bool) -> dict:
    import redis
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from broker.client.telemetry import read_heartbeats
    from broker.protocol.keys import Keys
    from broker.protocol.messages import Heartbeat
    from broker.prompts.tasks import TaskConfig, prompt_stream
    from deploy.launcher.procs import free_port
    from generators.config import SamplingConfig
    from learner.publish import Publisher

    seconds = 1.0 if quick else 20.0
    batch = 8
    sampling = SamplingConfig()  # the defaults a run uses: n 8, temperature 1, max_tokens 8
    keys = Keys("bench")
    stream = prompt_stream(TaskConfig(name="copy", seed=0))
    prompts = [next(stream).text for _ in range(64)]  # the broker feeds the same seeded prompts
    with tempfile.TemporaryDirectory(prefix="relay-bench-gen-") as tmp:
        base = str(bench_model(Path(tmp) / "base", quick))
        with torch_threads(1):
            raw_before, _ = _raw(kind, base, prompts, batch, sampling, seconds / 2)
        with Stack(Path(tmp) / "stack") as stack:
            url = stack.redis()
            r = redis.Redis.from_url(url)
            ingest, reward_port = f"tcp://127.0.0.1:{free_port()}", free_port()
            stack.service(
                "broker",
                "broker",
                {
                    "run_id": "bench",
                    "redis_url": url,
                    "ingest_bind": ingest,
                    "http_port": 0,
                    "max_queue_groups": 10**9,
                    "task": {"name": "copy", "seed": 0},
                },
            )
            stack.service("reward", "reward", {"port": reward_port})
            Publisher(
                r, keys, str(Path(tmp) / "weights"), AutoTokenizer.from_pretrained(base), 3, stack.announce_key
            ).publish(
                *(lambda m: (m, m.state_dict()))(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)), 0
            )
            gen = stack.service(
                "gen-0",
                "generator",
                {
                    "id": "gen-0",
                    "run_id": "bench",
                    "redis_url": url,
                    "broker_address": ingest,
                    "reward_url": f"http://127.0.0.1:{reward_port}",
                    "backend": backend_config(kind),
                    "sampling": sampling.model_dump(),
                    "prompts_per_batch": batch,
                    "heartbeat_s": 0.001,
                },
            )

            def hb() -> Heartbeat:
                return read_heartbeats(r, keys).get("gen-0") or Heartbeat()

            first = wait_until(lambda: (h := hb()).groups_sent >= batch and h, 600, "the generator's first batch", gen)
            time.sleep(seconds)
            last = wait_until(lambda: (h := hb()).tokens > first.tokens and h, 300, "another batch", gen)
            # heartbeats are sent at the end of a batch; wait for the one that closes the batch in flight
            tokens_seen = last.tokens
            last = wait_until(lambda: (h := hb()).tokens > tokens_seen and h, 300, "a batch end", gen)
            value = (last.tokens - first.tokens) / (last.last_seen - first.last_seen)
            sent = last.groups_sent - first.groups_sent
        with torch_threads(1):
            raw_after, _ = _raw(kind, base, prompts, batch, sampling, seconds / 2)
    baseline = (raw_before + raw_after) / 2
    return row(
        f"generator/{kind}",
        value,
        baseline,
        "tokens/s",
        TARGET,
        "higher",
        {
            "prompts_per_batch": batch,
            "n": sampling.n,
            "max_tokens": sampling.max_tokens,
            "groups_timed": sent,
            "tokens_timed": last.tokens - first.tokens,
            "raw_before_tokens_per_s": raw_before,
            "raw_after_tokens_per_s": raw_after,
            "model": "tiny (166k)" if quick else "~52M Llama (hidden 640, 8 layers)",
        },
    )


def run(quick: bool, include_vllm: bool = True, include_sglang: bool = False) -> list[dict]:
    rows = [measure("torch", quick)]
    why = vllm_missing() if include_vllm else "skipped in --quick mode (vLLM starts in ~20 s); name it to run it"
    rows.append(skipped("generator/vllm", why, "tokens/s", TARGET, "higher") if why else measure("vllm", quick))
    if include_sglang:
        why = None if sglang_python() else "SGLang's own environment is not built (make sglang-env)"
        rows.append(skipped("generator/sglang", why, "tokens/s", TARGET, "higher") if why else measure("sglang", quick))
        from benchmarks import sglang_mask

        rows += sglang_mask.run(quick, sglang_python())
    return rows
