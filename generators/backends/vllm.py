"""The ``vllm`` backend: one vLLM engine, created once per process and driven step by step.

Behaviour log-probs: the engine runs with ``logprobs_mode="processed_logprobs"``, so the log-prob
vLLM reports for a sampled token is taken from the distribution after temperature, top-k and top-p,
the one the token was actually drawn from. The learner recomputes through
:func:`broker.protocol.sampling.sampling_logprobs`, the same transform (the ``vllm`` case of
tests/integration/test_generator.py checks the two agree on the same weights).

Weights: ``update_weights`` calls ``reload_weights`` on the engine's workers (vLLM reads the
snapshot's safetensors in place into the existing parameters), then resets the prefix cache so no
KV computed by the old weights is reused. The engine object is never rebuilt; ``engine_info``
reports its PID and identity so a restart would be visible.

LoRA adapters published alone (learner.lora.publish): an engine whose first version carries an
adapter starts with ``enable_lora``; each version's adapter gets a new ``LoRARequest`` id, loaded
when the version is applied; the previous one is removed once its requests have finished. Every
request of a batch uses the adapter served when the batch started (docs/generators.md, "LoRA
adapters in vLLM").

The engine core runs inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one process per
generator replica, no extra IPC hop, and ``generate`` can call the in-flight hook between engine
steps.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from broker.protocol.weightstore import ADAPTER_CONFIG, ADAPTER_SETTINGS
from generators.backends.base import Completion, HFText, StepHook
from generators.config import SamplingConfig, VLLMBackendConfig

log = logging.getLogger("relay.generator.vllm")

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts


def _adapter_settings(folder: Path) -> dict | None:
    """The adapter_config.json of a version folder, None when it has no LoRA adapter."""
    f = folder / ADAPTER_CONFIG
    return json.loads(f.read_text()) if f.is_file() else None


def _arch(config_path: Path) -> dict:
    cfg = json.loads(config_path.read_text())
    return {k: v for k, v in cfg.items() if k not in ("transformers_version", "torch_dtype", "dtype")}


def _copy_embedding(worker, weight) -> None:
    """Runs on the vLLM worker (in this process): the new embedding into the rows of the (padded,
    tied) vocabulary parameter."""
    import torch

    model = worker.model_runner.get_model()
    param = model.get_parameter("model.embed_tokens.weight")
    with torch.no_grad():
        param.data[: weight.shape[0]].copy_(weight.to(param.dtype))
    # layers sharing the tensor (the tied lm_head) re-derive what they computed from it (on CPU: the
    # packed GEMM weight the logits are computed with)
    for module in model.modules():
        w = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if isinstance(w, torch.Tensor) and w.data_ptr() == param.data_ptr() and method is not None:
            method.process_weights_after_loading(module)


class VLLMBackend(HFText):
    name = "vllm"
    supports_in_flight = VLLMBackendConfig.supports_in_flight  # declared with its config (the validator reads it there)

    def __init__(self, cfg: VLLMBackendConfig):
        self.cfg = cfg
        self.llm = None
        self.tokenizer = None
        self._arch: dict = {}
        self._requests = 0
        self._cache_dirty = False
        self._tied = False
        self.engines_built = 0
        # LoRA adapters published alone (learner.lora.publish): the adapter every request uses, its settings,
        # the last id given, and the ids of the previous versions' adapters, removed once no request uses them
        self._lora = None
        self._adapter: dict | None = None
        self._lora_ids = 0
        self._retired: list[int] = []

    # -- engine ---------------------------------------------------------------------------------

    def load(self, path: str) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self.cfg.cpu_kv_cache_gib))))
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.eos_token_id = self.tokenizer.eos_token_id
        kwargs = dict(
            model=path,
            tokenizer=path,
            dtype=self.cfg.dtype,
            enforce_eager=self.cfg.enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=self.cfg.enable_prefix_caching,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            seed=0,
        )
        if self.cfg.max_model_len:
            kwargs["max_model_len"] = self.cfg.max_model_len
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = self.cfg.gpu_memory_utilization
        else:
            # vLLM 0.32 on CPU: a prompt prefilled in chunks (a batch of more than max_num_batched_tokens, 4096,
            # prompt tokens) has its per-request seeded generator rewound, which CPU generators refuse
            # ("CPU Generator does not use offset"), killing the engine: whole prompts only
            kwargs["enable_chunked_prefill"] = False
        adapter = _adapter_settings(Path(path))
        if adapter is not None:  # LoRA adapters published alone: an engine that serves them
            rank = int(adapter["r"])
            kwargs.update(
                enable_lora=True,
                max_lora_rank=next((r for r in LORA_RANKS if r >= rank), rank),
                max_loras=2,
                max_cpu_loras=2,
            )  # the old and the new version side by side
        kwargs.update(self.cfg.engine_kwargs)
        t0 = time.monotonic()
        self.llm = LLM(**kwargs)
        self.engines_built += 1
        self._arch = _arch(Path(path) / "config.json")
        self._tied = bool(self._arch.get("tie_word_embeddings"))
        if self._tied and self.cfg.tensor_parallel_size > 1:
            raise ValueError(
                "in-place weight updates of a model with tied embeddings need tensor_parallel_size = 1 "
                "with vLLM 0.32 (its in-place reload restores the old tied lm_head; see "
                "docs/generators.md)"
            )
        log.info("vLLM engine ready in %.1fs (pid %d)", time.monotonic() - t0, os.getpid())
        if adapter is not None:
            self._set_adapter(path)

    def engine_info(self) -> dict:
        """Identity of the running engine: the same PID and object id across updates means no restart."""
        engine = self.llm.llm_engine if self.llm is not None else None
        return {"pid": os.getpid(), "engine_id": id(engine), "engines_built": self.engines_built}

    def update_weights(self, path: str) -> None:
        """Load version ``path`` in place: a whole model (``reload_weights``), or a LoRA adapter alone (a new
        adapter id, :meth:`_set_adapter`)."""
        if not (Path(path) / "config.json").is_file() and (Path(path) / ADAPTER_CONFIG).is_file():
            self._set_adapter(path)
            return
        if _arch(Path(path) / "config.json") != self._arch:
            raise ValueError("the snapshot's config.json differs from the served model's architecture")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        if self._tied:
            # vLLM 0.32's layerwise in-place reload puts the *old* tensor back into a layer that loaded
            # nothing, and the tied lm_head shares its tensor with the embedding it skipped, so the
            # new embedding is overwritten. Copy it again, by name, as-is (measured: without this the
            # generator's log-probs drift from the learner's by a KL of 2-6 nats within 100 versions).
            from safetensors import safe_open

            name = "model.embed_tokens.weight"
            for f in sorted(Path(path).glob("*.safetensors")):
                with safe_open(str(f), "pt") as st:
                    if name in st.keys():
                        self.llm.collective_rpc(_copy_embedding, args=(st.get_tensor(name),))
                        break
            else:
                raise ValueError(f"the snapshot has no {name}")
        # KV blocks cached by the old weights must not serve new requests. With requests running
        # (in-flight "continue") the reset cannot happen yet; it is repeated when the batch ends.
        self._cache_dirty = not self.llm.reset_prefix_cache()
        if (Path(path) / ADAPTER_CONFIG).is_file():
            self._set_adapter(path)
        elif self._lora is not None:
            raise ValueError(
                "this engine serves LoRA adapters; a version without an adapter would be served with "
                "the last one (restart the generator to serve whole models)"
            )

    def _set_adapter(self, path: str) -> None:
        """Serve the LoRA adapter in folder ``path`` to every request from now on: a new adapter id and name
        (vLLM caches adapters by id and groups requests by name), loaded now so a bad adapter is refused
        here and not at the next batch; the previous one is removed once no request uses it."""
        from vllm.lora.request import LoRARequest

        settings = _adapter_settings(Path(path))
        if not self.llm.llm_engine.vllm_config.lora_config:
            raise ValueError(
                f"{path} is a LoRA adapter, but this engine was started without LoRA (its first version "
                "was a whole model): restart the generator"
            )
        if self._adapter is not None and {k: settings.get(k) for k in ADAPTER_SETTINGS} != {
            k: self._adapter.get(k) for k in ADAPTER_SETTINGS
        }:
            raise ValueError(f"{path}: adapter settings differ from those of the adapter served")
        self._lora_ids += 1
        request = LoRARequest(f"relay-{self._lora_ids}", self._lora_ids, str(Path(path).resolve()))
        try:
            self.llm.llm_engine.add_lora(request)
        except Exception as e:  # vLLM raises ValueError, KeyError, RuntimeError... for a bad adapter: refused
            raise ValueError(f"{path}: vLLM cannot load the adapter: {type(e).__name__}: {e}") from e
        if self._lora is not None:
            self._retired.append(self._lora.lora_int_id)
        self._lora, self._adapter = request, settings
        if not self.llm.llm_engine.has_unfinished_requests():
            self._remove_retired()

    def _remove_retired(self) -> None:
        for lora_id in self._retired:
            self.llm.llm_engine.remove_lora(lora_id)
        self._retired.clear()

    # -- sampling -------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, on_step: StepHook | None = None
    ) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        n = sampling.n
        # "finish": one request per prompt with n samples (vLLM shares the prompt's prefill). In-flight
        # "continue" needs each sample's own token count at a switch: one request per sample.
        # With a LoRA adapter every request keeps the adapter it started with: a version applied between two
        # steps would serve only later requests, so new versions wait for the batch's end (no in-flight switch).
        if self._lora is not None:
            on_step = None
        per_sample = on_step is not None
        ids: list[str] = []
        for i, p in enumerate(prompts):
            for j in range(n if per_sample else 1):
                self._requests += 1
                rid = f"r{self._requests}"
                params = SamplingParams(
                    n=1 if per_sample else n,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                    max_tokens=sampling.max_tokens,
                    logprobs=0,
                    seed=(seed * 1_000_003 + i * n + j) % (2**31),
                    # per sample: each step's running length; per prompt: the n outputs at the end
                    output_kind=RequestOutputKind.CUMULATIVE if per_sample else RequestOutputKind.FINAL_ONLY,
                )
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), params, lora_request=self._lora)
                ids.append(rid)
        version = initial = on_step() if on_step is not None else -1
        switches: list[tuple[int, dict[str, int]]] = []  # (new version, tokens each request had by then)
        lengths = dict.fromkeys(ids, 0)
        final = {}
        while engine.has_unfinished_requests():
            self.alive()
            if on_step is not None:
                v = on_step()  # may reload weights right here, between two engine steps
                if v != version:
                    version = v
                    switches.append((v, dict(lengths)))
            for out in engine.step():
                if per_sample:
                    lengths[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    if len(out.outputs) != (1 if per_sample else n):
                        raise RuntimeError(f"vLLM finished request {out.request_id} with {len(out.outputs)} outputs")
                    final[out.request_id] = out.outputs
        if self._cache_dirty:
            self._cache_dirty = not self.llm.reset_prefix_cache()
        if self._retired:
            self._remove_retired()
        result: list[list[Completion]] = []
        for k, rid in enumerate(ids):
            if not per_sample or k % n == 0:
                result.append([])
            for o in final[rid]:  # n outputs per request, or one per sample
                toks = list(o.token_ids)
                lps = [float(o.logprobs[t][tok].logprob) for t, tok in enumerate(toks)]
                versions = None
                if per_sample:
                    versions, v = [], initial
                    for new_v, seen in switches:
                        versions += [v] * (min(seen[rid], len(toks)) - len(versions))
                        v = new_v
                    versions += [v] * (len(toks) - len(versions))
                result[-1].append(Completion(toks, lps, "stop" if o.finish_reason == "stop" else "length", versions))
        return result
