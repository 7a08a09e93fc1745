"""The ``torch`` backend: transformers model, batched sampling with a KV cache, exact behaviour
log-probs from :func:`broker.protocol.sampling.sampling_logprobs`. Weights update in place with
``load_state_dict`` into the same module (no new engine). LoRA adapters published alone
(learner.lora.publish) are added to the model once by peft and then loaded into those same
adapter parameters, version after version (generators/backends/torch_lora.py)."""

from __future__ import annotations

import inspect
import json
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from broker.protocol.hfcache import cache_kwarg
from broker.protocol.sampling import sample, sampling_logprobs
from broker.protocol.weightstore import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    MappedFile,
    Verified,
    is_adapter_tensor,
)
from generators.backends.base import Completion, HFText, StepHook
from generators.backends.torch_attention import attn_implementation
from generators.backends.torch_lora import adapter_settings, attach_adapter, base_layer_name, copy_adapter
from generators.config import SamplingConfig, TorchBackendConfig

log = logging.getLogger("relay.generator.torch")


def _no_init_weights():
    """transformers' context that skips the random initialisation of a model built from its config."""
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def mapped_tensors(m: MappedFile) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file mapped by ``weightstore.check(keep=True)``: CPU views of the bytes
    that were hashed (read-only memory: only ever copied from). A tensor whose offset does not suit its
    dtype's alignment (the format does not pad) is copied out first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": the views are only read
        raw = torch.frombuffer(m.mapping, dtype=torch.uint8)
    out = {}
    for begin, end, name, dtype, shape in m.tensors:
        dt = getattr(torch, dtype)
        part = raw[begin:end]
        if begin % dt.itemsize:
            part = part.clone()
        out[name] = part.view(dt).view(shape)
    return out


class TorchBackend(HFText):
    name = "torch"
    supports_in_flight = (
        TorchBackendConfig.supports_in_flight
    )  # declared with its config (the validator reads it there)
    loads_mapped_files = True  # load/update_weights(path, verified=...): loads the bytes weightstore.check hashed

    def __init__(self, cfg: TorchBackendConfig):
        self.cfg = cfg
        torch.set_num_threads(cfg.threads)
        self.model = None
        self.tokenizer = None
        self.dtype = getattr(torch, cfg.dtype)
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"backend.device is {cfg.device!r} but torch sees no CUDA device")
        self.device = torch.device(cfg.device)

    def load(self, path: str, verified: Verified | None = None) -> None:
        """Start the engine from version ``path``; with ``verified`` (``weightstore.check(keep=True)``), from
        the bytes that check hashed: the tensors from its mapped files, the config and tokenizer from the
        bytes it kept (written into a private temporary folder for transformers to read), so nothing is
        opened again by name after the check."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.adapter = None  # the LoRA adapter's settings (adapter_config.json) once the model has adapters
        if verified is None:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = (
                AutoModelForCausalLM.from_pretrained(
                    path, dtype=self.dtype, attn_implementation=attn_implementation(self.device)
                )
                .to(self.device)
                .eval()
            )
            self._config = json.loads((Path(path) / "config.json").read_text())
        else:
            self._load_verified(verified)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_id
        )
        if (ADAPTER_CONFIG in verified.blobs) if verified is not None else (Path(path) / ADAPTER_CONFIG).is_file():
            self._load_adapter(path, verified)

    def _load_verified(self, v: Verified) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        with tempfile.TemporaryDirectory(prefix="relay-verified-") as folder:  # mode 0700: this process's own
            for name, data in v.blobs.items():
                (Path(folder) / name).write_bytes(data)
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            config = AutoConfig.from_pretrained(folder)
        with _no_init_weights(), self.device:  # the weights come from the mapped files: no random init first
            self.model = AutoModelForCausalLM.from_config(
                config, dtype=self.dtype, attn_implementation=attn_implementation(self.device)
            )
        self.model.tie_weights()
        self._config = json.loads(v.blobs["config.json"])
        self._load_state(
            {k: t for name in sorted(v.files) if name != ADAPTER_FILE for k, t in mapped_tensors(v.files[name]).items()}
        )
        self.model.eval()

    def engine_info(self) -> dict:
        """Identity of the running engine: the same PID and module across updates means no restart."""
        return {"pid": os.getpid(), "engine_id": id(self.model)}

    def update_weights(
        self, path: str, files: dict[str, MappedFile] | None = None, verified: Verified | None = None
    ) -> None:
        """Load version ``path`` in place: a whole model (its tensors into the same parameters; with a LoRA
        adapter beside it, the adapter too), or a LoRA adapter alone (:meth:`_load_adapter`). ``verified``
        (``weightstore.check(keep=True)``; ``files``: its mapped safetensors files alone): the bytes that check
        hashed are loaded, instead of opening the files again (what is loaded is what was verified, whatever
        was renamed into the folder since)."""
        files = verified.files if verified is not None else files
        blobs = verified.blobs if verified is not None else None
        has = (lambda name: name in blobs) if blobs is not None else (lambda name: (Path(path) / name).is_file())
        if not has("config.json") and has(ADAPTER_CONFIG):
            self._load_adapter(path, verified)
            return
        raw = blobs["config.json"] if blobs is not None else (Path(path) / "config.json").read_bytes()
        cfg = json.loads(raw)
        if {k: v for k, v in cfg.items() if k != "transformers_version"} != {
            k: v for k, v in self._config.items() if k != "transformers_version"
        }:
            raise ValueError("the snapshot's config.json differs from the served model's architecture")
        state = {}
        if files is not None:
            for name in sorted(files):
                if name != ADAPTER_FILE:
                    state.update(mapped_tensors(files[name]))
        else:
            for f in sorted(Path(path).glob("*.safetensors")):
                if f.name != ADAPTER_FILE:
                    state.update(load_file(f, device=str(self.device)))
        self._load_state(state)
        if has(ADAPTER_CONFIG):
            self._load_adapter(path, verified)
        elif self.adapter is not None:  # a whole model without adapter (merged): the adapters add nothing now
            with torch.no_grad():
                for k, p in self.model.named_parameters():
                    if ".lora_B." in k:
                        p.zero_()

    def _load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a whole model's tensors into the model's parameters (ValueError when they do not match)."""
        own = self.model.state_dict()
        # a layer that carries an adapter holds its own weight under <module>.base_layer.<weight|bias>
        state = {k if k in own else base_layer_name(k): v for k, v in state.items()}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # tied embeddings: lm_head.weight may be absent from the file; the adapters come from their own file
        missing = [
            k
            for k in missing
            if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings) and not is_adapter_tensor(k)
        ]
        if missing or unexpected:
            raise ValueError(
                f"snapshot tensors do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )

    def _load_adapter(self, path: str, verified: Verified | None = None) -> None:
        """Load the LoRA adapter of version ``path`` (PEFT's layout: adapter_config.json and
        adapter_model.safetensors) into the model's adapters in place, adding them (peft) to the model on the
        first one. All or nothing: ValueError, the model unchanged, when the settings differ from the
        adapters the model has, or the tensors are not exactly one A and one B per adapted layer."""
        wanted = adapter_settings(path, verified, self.adapter)
        tensors = (
            mapped_tensors(verified.files[ADAPTER_FILE])
            if verified is not None
            else load_file(Path(path) / ADAPTER_FILE, device=str(self.device))
        )
        if self.adapter is None:
            attach_adapter(self.model, wanted, path)
            self.adapter = wanted
        copy_adapter(self.model, tensors, path)

    def update_weights_from_tensors(self, state: dict[str, torch.Tensor], adopt: bool = False) -> bool:
        """Copy ``state`` (CPU tensors, any float dtype; the collective transport) into the model's
        parameters in place. Checked first, all or nothing: every tensor of the model (``lm_head.weight``
        may be absent when tied) with its shape; ValueError otherwise and nothing is changed.

        With ``adopt``, when ``state`` holds exactly the model's parameters, each in its parameter's dtype
        and on its device, the parameters take the tensors' memory instead (``param.data = tensor``: the
        same Parameter objects, tied ones included, now viewing the caller's buffer; one pass over the
        weights less). Returns True when they did: the caller must then leave that memory alone."""
        own = self.model.state_dict()
        tied = self.model.config.tie_word_embeddings
        missing = [k for k in own if k not in state and not (k == "lm_head.weight" and tied)]
        unexpected = [k for k in state if k not in own]
        wrong = [k for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape)]
        if missing or unexpected or wrong:
            raise ValueError(
                f"received tensors do not match the model: missing {missing[:3]}, unexpected "
                f"{unexpected[:3]}, wrong shape {wrong[:3]}"
            )
        params = dict(self.model.named_parameters())  # a tied head appears once, under the embedding's name
        if (
            adopt
            and set(params) == set(state)
            and all(state[k].dtype == p.dtype and state[k].device == p.device for k, p in params.items())
        ):
            with torch.no_grad():
                for k, p in params.items():
                    p.data = state[k]
            return True
        with torch.no_grad():
            for k, t in state.items():
                own[k].copy_(t)
        return False

    def _check_context(self, prompt: int, budget: int) -> None:
        """Refuse a prompt + generation budget past the model's context (its position embeddings): the
        positions beyond it were never trained (or do not exist), and the KV cache would outgrow it."""
        cfg = (
            self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        )
        context = getattr(cfg, "max_position_embeddings", None)
        if isinstance(context, int) and prompt + budget > context:
            raise ValueError(
                f"a prompt of {prompt} tokens + generator.sampling.max_tokens ({budget}) is more than the model's "
                f"context of {context} positions: lower generator.sampling.max_tokens to {max(context - prompt, 0)} "
                "or less, or shorten the prompts (broker.dataset.max_prompt_tokens; docs/datasets.md)"
            )

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, on_step: StepHook | None = None
    ) -> list[list[Completion]]:
        n = sampling.n
        P = max(len(p) for p in prompts)
        self._check_context(P, sampling.max_tokens)
        ids = torch.full((len(prompts), P), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, P - len(p) :] = torch.tensor(p)
            attn[i, P - len(p) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        version = on_step() if on_step is not None else -1
        # one prefill per prompt, then its KV cache is copied to the n rows of its group (row i*n+j is
        # sample j of prompt i): the group's prompt is computed once, not n times
        # the cache is ours, filled in place by every forward (never read back from the output, whose field
        # name also changed across transformers versions)
        past = DynamicCache(config=self.model.config)
        kv = {cache_kwarg(self.model): past}
        if "logits_to_keep" in inspect.signature(self.model.forward).parameters:
            kv["logits_to_keep"] = 1  # the prefill's last position only: not [prompts, P, vocab] of logits
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **kv)
        kv.pop("logits_to_keep", None)
        logits = out.logits[:, -1].repeat_interleave(n, dim=0)
        if n > 1:
            past.batch_repeat_interleave(n)
        attn, pos = attn.repeat_interleave(n, dim=0), pos.repeat_interleave(n, dim=0)
        B = attn.shape[0]
        next_pos = pos[:, -1] + 1
        tokens = torch.zeros((B, sampling.max_tokens), dtype=torch.long, device=self.device)
        lps = torch.zeros((B, sampling.max_tokens), device=self.device)
        stopped = torch.zeros(B, dtype=torch.bool, device=self.device)  # row i ended on the EOS token
        lengths = torch.full((B,), sampling.max_tokens, dtype=torch.long, device=self.device)
        versions = [version] * sampling.max_tokens  # version of the forward pass that gave token t's logits
        # the decode batch holds the rows still sampling (``rows``: their index in the result); a finished
        # row is dropped from it, and from the KV cache, once a quarter of the batch has finished: a step's
        # decode costs what its live rows cost, and the cache is compacted a few times per call, not per row
        rows = torch.arange(B, device=self.device)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)  # per row of the decode batch
        for t in range(sampling.max_tokens):
            self.alive()
            if self.cfg.step_latency_s:
                time.sleep(self.cfg.step_latency_s)
            logp = sampling_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            tok = sample(logp, gen)
            tokens[rows, t] = tok
            lps[rows, t] = logp.gather(-1, tok[:, None]).squeeze(-1)
            just_done = (~done) & (tok == self.eos_token_id)
            lengths[rows[just_done]] = t + 1
            stopped[rows[just_done]] = True
            done |= just_done
            if bool(done.all()) or t == sampling.max_tokens - 1:
                break
            if 4 * int(done.sum()) >= len(rows):
                keep = (~done).nonzero().squeeze(-1)
                past.batch_select_indices(keep)
                rows, done, tok, attn, next_pos = rows[keep], done[keep], tok[keep], attn[keep], next_pos[keep]
            tok = tok.masked_fill(done, self.pad_token_id)
            attn = torch.cat([attn, (~done).long()[:, None]], dim=1)
            if on_step is not None:  # a new version may load here: the next token's logits use it (the KV
                version = on_step()  # cache of earlier tokens stays as the old weights computed it)
                versions[t + 1 :] = [version] * (sampling.max_tokens - t - 1)
            out = self.model(
                input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None], use_cache=True, **kv
            )
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
        tokens, lps, stopped, lengths = tokens.cpu(), lps.cpu(), stopped.cpu(), lengths.cpu()
        result: list[list[Completion]] = []
        for i in range(B):
            L = int(lengths[i])
            c = Completion(
                tokens[i, :L].tolist(),
                lps[i, :L].tolist(),
                "stop" if bool(stopped[i]) else "length",
                versions[:L] if on_step is not None else None,
            )
            if i % n == 0:
                result.append([])
            result[-1].append(c)
        return result
