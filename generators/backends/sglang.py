"""The ``sglang`` backend: an SGLang server (0.5.23), driven over its native HTTP API.

The server is either started by this backend (``launch.python``: SGLang's own environment, one server per
generator, generators/backends/sglang_server.py) or by someone else (``url``). Shapes as served by SGLang
0.5.23 (``sglang/srt/entrypoints/http_server.py``, ``sglang/srt/managers/io_struct.py``): ``/generate``
takes ``input_ids`` (a batch), ``sampling_params`` and ``return_logprob``/``top_logprobs_num``; ``/model_info``
reports ``is_generation``, ``architectures`` and ``weight_version`` (load checks them); each answer
has ``output_ids`` and ``meta_info`` with ``output_token_logprobs`` (``[logprob, token_id, text]``),
``output_top_logprobs``, ``finish_reason`` and ``weight_version``.

Behaviour log-probs: SGLang reports log_softmax(logits / temperature), taken before any top-k or top-p
filter (``SGLANG_RETURN_ORIGINAL_LOGPROB`` must stay unset: it switches to pre-temperature log-probs). With
top-k or top-p (one of the two: SGLang's top-p counts the mass before top-k's renormalisation, the learner's
after it) the backend asks for ``return_sampling_mask`` in its ``selected`` mode: SGLang's own log-prob of
each sampled token within the set its sampler kept, log(p / kept mass) with p of softmax(logits /
temperature) (``Sampler._build_sampling_mask_output`` in sglang/srt/layers/sampler.py), which is the
learner's :func:`broker.protocol.sampling.sampling_logprobs`: the log-prob of the distribution actually
sampled from. SGLang 0.5.23 returns a mask only for a finite ``top_k`` of at most its
``--sampling-mask-max-tokens`` (4096 by default), so top-p is sent with ``top_k`` = the vocabulary size (a
filter that keeps everything) and a launched server gets ``--sampling-mask-max-tokens`` = the vocabulary size,
or top_k with top-k (``launch.sampling_mask_max_tokens``: SGLang packs and copies a row of that many ids per
sequence at every decode step, docs/generators.md); a server of your own needs it too for a vocabulary over
4096 (else its 400 names the flag). (Before, the
backend asked for the top ``top_logprobs_num`` log-probs, the whole vocabulary for top-p, and renormalised
them itself.)

Weights: ``/update_weights_from_disk`` with the version folder and its version as ``weight_version``,
``flush_cache`` (no radix-cache entry of the old weights is reused) and ``abort_all_requests`` (a request
left running on the server by a client-side timeout does not hold the update back); then ``/model_info``
must report that version, and every ``/generate`` answer's ``weight_version`` is checked against it. (0.5.23
wants ``/begin_weight_update`` ... ``/end_weight_update`` around ``/update_weights_from_tensor`` and
``/update_weights_from_distributed`` only, not around ``/update_weights_from_disk``:
sglang/srt/managers/scheduler_components/weight_updater.py.) The server process is never restarted: ``engine_info`` reports its PID (a launched
server) and the version it serves.

In-flight ``continue``: generation runs in chunks of ``continue_chunk_tokens`` tokens (each chunk a
``/generate`` of prompt + tokens so far); the generator may apply a newer version between chunks, so every
token's version is known (``Completion.versions``). ``finish``: one ``/generate`` per batch.
"""

from __future__ import annotations

import atexit
import logging
from pathlib import Path

import httpx

from broker.protocol import weightstore
from generators.backends.base import Completion, HFText, StepHook
from generators.config import SamplingConfig, SGLangBackendConfig

log = logging.getLogger("relay.generator.sglang")


MASK_CAP = "--sampling-mask-max-tokens"  # SGLang's bound on a sampling mask's size, and so on top_k with one


class SGLangError(RuntimeError):
    pass


class SGLangBackend(HFText):
    name = "sglang"
    supports_in_flight = SGLangBackendConfig.supports_in_flight  # declared with its config (the validator reads it)

    def __init__(self, cfg: SGLangBackendConfig):
        self.cfg = cfg
        self.server = None  # a LaunchedServer when this backend started it
        self.http: httpx.Client | None = None
        self.tokenizer = None
        self.version_label = ""
        self.vocab_size = 0
        self.servers_started = 0

    def _connect(self, url: str, api_key: str) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=self.cfg.timeout_s, headers=headers)

    def _call(self, method: str, route: str, body: dict | None = None) -> httpx.Response:
        try:
            resp = self.http.request(method, route, json=body)
        except httpx.HTTPError as e:
            raise SGLangError(f"SGLang server {self.http.base_url}{route}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 400:
            raise SGLangError(
                f"SGLang server {self.http.base_url}{route} answered {resp.status_code}: {resp.text[:300]}"
            )
        return resp

    # -- engine ---------------------------------------------------------------------------------

    def load(self, path: str) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.vocab_size = AutoConfig.from_pretrained(path).vocab_size
        if self.cfg.launch.python:
            from generators.backends.sglang_server import launch_sglang, new_key

            launch = self.cfg.launch
            key = self.cfg.api_key or new_key()  # a launched server always requires a key
            args = list(launch.args)
            if not any(a.startswith(MASK_CAP) for a in args):  # top-k's k; top-p's top_k: the vocabulary
                args += [MASK_CAP, str(launch.sampling_mask_max_tokens or self.vocab_size)]
            self.server = launch_sglang(launch.python, path, args, launch.env, launch.start_timeout_s, key)
            self.servers_started += 1
            atexit.register(self.close)
            self._connect(self.server.url, key)
        else:
            self._connect(self.cfg.url, self.cfg.api_key)
        self._check_model(path)
        self.update_weights(path)  # the server may have started from other weights: serve exactly this snapshot

    def _check_model(self, path: str) -> None:
        """``/model_info`` (0.5.23's name for the deprecated ``/get_model_info``): a generating model of the
        snapshot's architecture."""
        import json

        info = self._call("GET", "/model_info").json()
        if not info.get("is_generation", False):
            raise SGLangError(
                f"the SGLang server at {self.http.base_url} serves a model that does not generate: {info}"
            )
        ours = json.loads((Path(path) / "config.json").read_text()).get("architectures")
        if info.get("architectures") != ours:
            raise SGLangError(f"the SGLang server serves {info.get('architectures')}, the snapshot is {ours}")
        log.info("SGLang server %s serves %s (%s)", self.http.base_url, info.get("model_path"), ours)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    def update_weights(self, path: str) -> None:
        """Load folder ``path`` in place, labelled with its version; a plain model folder (no weight-store
        manifest: a benchmark's base model) keeps the label SGLang gives it."""
        version = (
            str(weightstore.read_manifest(path)["version"]) if (Path(path) / weightstore.MANIFEST).is_file() else None
        )
        body = {"model_path": path, "flush_cache": True, "abort_all_requests": True}
        if version is not None:
            body["weight_version"] = version
        out = self._call("POST", "/update_weights_from_disk", body).json()
        if not out.get("success", False):
            raise ValueError(f"SGLang refused the weights: {out.get('message', '')}")
        served = str(self._call("GET", "/model_info").json().get("weight_version"))
        if version is not None and served != version:
            raise SGLangError(f"SGLang reports weight version {served} after loading version {version}")
        self.version_label = served

    def engine_info(self) -> dict:
        """The server's identity: the same ``server_pid`` across updates means the weights were applied in place."""
        return {
            "url": str(self.http.base_url) if self.http is not None else self.cfg.url,
            "server_pid": self.server.pid if self.server is not None else None,
            "servers_started": self.servers_started,
            "weight_version": self.version_label,
        }

    # -- sampling -------------------------------------------------------------------------------

    def _request(self, rows: list[list[int]], sampling: SamplingConfig, max_tokens: int) -> list[dict]:
        greedy = sampling.top_k == 1  # e.g. evaluation: SGLang's temperature 0; the chosen token has log-prob 0
        params = {
            "temperature": 0.0 if greedy else sampling.temperature,
            "max_new_tokens": max_tokens,
            "stop_token_ids": [self.eos_token_id],
            "skip_special_tokens": False,
        }
        body: dict = {"input_ids": rows, "sampling_params": params, "return_logprob": True}
        if not greedy and (sampling.top_k or sampling.top_p < 1.0):
            # SGLang returns a sampling mask only with a finite top_k: top-p's is the whole vocabulary (a no-op)
            params.update(top_k=min(sampling.top_k or self.vocab_size, self.vocab_size), top_p=sampling.top_p)
            # each sampled token's log-prob within the set SGLang kept (not a log-prob per token of that set)
            body.update(return_sampling_mask=True, sampling_logprobs_mode="selected")
        answers = self._call("POST", "/generate", body).json()
        if isinstance(answers, dict):
            answers = [answers]
        if len(answers) != len(rows):
            raise SGLangError(f"/generate answered {len(answers)} results for {len(rows)} prompts")
        return answers

    def _read(self, answer: dict, sampling: SamplingConfig) -> tuple[list[int], list[float], str]:
        """(tokens, behaviour log-probs, finish reason) of one answer, its weight version checked."""
        meta = answer["meta_info"]
        served = meta.get("weight_version")
        if str(served) != self.version_label:
            raise SGLangError(
                f"SGLang served weight version {served}, expected {self.version_label}: was the server "
                "updated by someone else?"
            )
        triples = meta["output_token_logprobs"]
        toks = [int(t[1]) for t in triples]
        if answer.get("output_ids") is not None and list(answer["output_ids"]) != toks:
            raise SGLangError("output_ids and output_token_logprobs disagree")
        if sampling.top_k == 1:
            lps = [0.0] * len(toks)
        elif sampling.top_k or sampling.top_p < 1.0:
            lps = [float(x) for x in meta.get("output_token_sampling_logprobs") or []]
            if len(lps) != len(toks):
                raise SGLangError(f"/generate gave {len(lps)} sampling log-probs for {len(toks)} tokens")
        else:
            lps = [float(t[0]) for t in triples]
        finish = (meta.get("finish_reason") or {}).get("type", "length")
        return toks, lps, "stop" if finish == "stop" else "length"

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, on_step: StepHook | None = None
    ) -> list[list[Completion]]:
        n = sampling.n
        rows = [list(p) for p in prompts for _ in range(n)]
        if on_step is None:
            answers = self._request(rows, sampling, sampling.max_tokens)
            done = [Completion(*self._read(a, sampling)) for a in answers]
        else:
            done = self._generate_in_chunks(rows, sampling, on_step)
        return [done[i : i + n] for i in range(0, len(done), n)]

    def _generate_in_chunks(self, rows: list[list[int]], sampling: SamplingConfig, on_step: StepHook) -> list:
        """In-flight "continue": ``continue_chunk_tokens`` tokens per call, ``on_step`` (which may load a newer
        version) before each call; each token carries the version of the call that sampled it."""
        out = [Completion([], [], "length", []) for _ in rows]
        running = list(range(len(rows)))
        while running:
            self.alive()
            version = on_step()
            chunk = min(
                self.cfg.continue_chunk_tokens, sampling.max_tokens - min(len(out[i].token_ids) for i in running)
            )
            answers = self._request([rows[i] + out[i].token_ids for i in running], sampling, chunk)
            still = []
            for i, a in zip(running, answers):
                toks, lps, finish = self._read(a, sampling)
                c = out[i]
                room = sampling.max_tokens - len(c.token_ids)
                toks, lps = toks[:room], lps[:room]
                c.token_ids += toks
                c.logprobs += lps
                c.versions += [version] * len(toks)
                if finish == "stop" and toks and toks[-1] == self.eos_token_id:
                    c.finish_reason = "stop"
                elif toks and len(c.token_ids) < sampling.max_tokens:  # no token: the server's context is full
                    still.append(i)
            running = still
        return out
