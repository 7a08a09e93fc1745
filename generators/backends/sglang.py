"""The ``sglang`` backend: a separately started SGLang server, driven over its native HTTP API.

Request and response shapes follow SGLang's sources (sgl-project/sglang):
``python/sglang/srt/entrypoints/http_server.py`` (the routes: ``/generate``,
``/update_weights_from_disk``, ``/flush_cache``, ``/pause_generation``, ``/continue_generation``,
``/get_model_info``) and ``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput``:
``input_ids``, ``sampling_params``, ``return_logprob``; ``UpdateWeightFromDiskReqInput``:
``model_path``, ``weight_version``, ``flush_cache``; ``PauseGenerationReqInput``: ``mode``). A
``/generate`` answer per prompt carries ``output_ids`` and ``meta_info`` with
``output_token_logprobs`` as ``[logprob, token_id, text]`` triples, ``finish_reason`` as
``{"type": "stop" | "length", ...}`` and ``weight_version``.

Behaviour log-probs: SGLang's sampler reports log_softmax(logits / temperature), before any top-k or
top-p filter, so this backend refuses top-k and top-p (a ValueError at the first generate) rather
than report log-probs of a distribution that was not the one sampled from. Do not set
``SGLANG_RETURN_ORIGINAL_LOGPROB`` on the server: it switches to pre-temperature log-probs.

Weights: the snapshot folder is handed to ``/update_weights_from_disk`` with its version, so the
server must see the weight store under the same path (a shared volume). Updates happen between
batches (the "finish" in-flight policy). "continue" is refused: SGLang can pause, load and continue,
but its answer reports only the version at the end of a request, not where in a sequence the
weights changed, so per-token versions could not be recorded honestly. Each answer's
``meta_info.weight_version`` is checked against the version this backend loaded.
"""

from __future__ import annotations

import logging

import httpx

from broker.protocol import weightstore
from generators.backends.base import Completion, HFText, StepHook
from generators.config import SamplingConfig, SGLangBackendConfig

log = logging.getLogger("relay.generator.sglang")


class SGLangError(RuntimeError):
    pass


class SGLangBackend(HFText):
    name = "sglang"
    supports_in_flight = (
        SGLangBackendConfig.supports_in_flight
    )  # declared with its config (the validator reads it there)

    def __init__(self, cfg: SGLangBackendConfig):
        self.cfg = cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        self.http = httpx.Client(base_url=cfg.url.rstrip("/"), timeout=cfg.timeout_s, headers=headers)
        self.tokenizer = None
        self.version_label = ""

    def _post(self, route: str, body: dict) -> httpx.Response:
        try:
            resp = self.http.post(route, json=body)
        except httpx.HTTPError as e:
            raise SGLangError(f"SGLang server {self.cfg.url}{route}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 400:
            raise SGLangError(f"SGLang server {self.cfg.url}{route} answered {resp.status_code}: {resp.text[:300]}")
        return resp

    # -- engine ---------------------------------------------------------------------------------

    def load(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.eos_token_id = self.tokenizer.eos_token_id
        info = self.http.get("/get_model_info").json()
        log.info("SGLang server %s serves %s", self.cfg.url, info.get("model_path"))
        self.update_weights(path)  # the server may have started from other weights: serve exactly this snapshot

    def update_weights(self, path: str) -> None:
        version = weightstore.read_manifest(path)["version"]
        body = {"model_path": path, "weight_version": str(version), "flush_cache": True}
        out = self._post("/update_weights_from_disk", body).json()
        if not out.get("success", False):
            raise ValueError(f"SGLang refused the weights: {out.get('message', '')}")
        self.version_label = str(version)

    def engine_info(self) -> dict:
        return {"url": self.cfg.url, "weight_version": self.version_label}

    # -- sampling -------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, on_step: StepHook | None = None
    ) -> list[list[Completion]]:
        greedy = sampling.top_k == 1  # e.g. evaluation: SGLang's temperature 0; the chosen token has log-prob 0
        if not greedy and (sampling.top_k or sampling.top_p < 1.0):
            raise ValueError(
                "the sglang backend supports temperature only (or greedy, top_k=1): SGLang reports "
                "log-probs before top-k/top-p filtering, which would not be the behaviour policy's"
            )
        n = sampling.n
        rows = [list(p) for p in prompts for _ in range(n)]
        body = {
            "input_ids": rows,
            "sampling_params": {
                "temperature": 0.0 if greedy else sampling.temperature,
                "max_new_tokens": sampling.max_tokens,
                "stop_token_ids": [self.eos_token_id],
                "skip_special_tokens": False,
            },
            "return_logprob": True,
        }
        answers = self._post("/generate", body).json()
        if isinstance(answers, dict):
            answers = [answers]
        if len(answers) != len(rows):
            raise SGLangError(f"/generate answered {len(answers)} results for {len(rows)} prompts")
        result: list[list[Completion]] = []
        for k, a in enumerate(answers):
            meta = a["meta_info"]
            triples = meta["output_token_logprobs"]
            toks = [int(t[1]) for t in triples]
            if a.get("output_ids") is not None and list(a["output_ids"]) != toks:
                raise SGLangError("output_ids and output_token_logprobs disagree")
            lps = [0.0 if greedy else float(t[0]) for t in triples]
            finish = (meta.get("finish_reason") or {}).get("type", "length")
            served = meta.get("weight_version")
            if served is not None and str(served) != self.version_label:
                raise SGLangError(
                    f"SGLang served weight version {served}, expected {self.version_label}: was the "
                    "server updated by someone else?"
                )
            if k % n == 0:
                result.append([])
            result[-1].append(Completion(toks, lps, "stop" if finish == "stop" else "length"))
        return result
