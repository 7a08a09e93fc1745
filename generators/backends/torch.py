"""The ``torch`` backend: transformers model, batched sampling with a KV cache, exact behaviour
log-probs from :func:`broker.protocol.sampling.sampling_logprobs`. Weights update in place with
``load_state_dict`` into the same module (no new engine). LoRA adapters published alone
(learner.lora.publish) are added to the model once by peft and then loaded into those same
adapter parameters, version after version (generators/backends/torch_lora.py)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

from broker.protocol.weightstore import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    MappedFile,
    Verified,
    is_adapter_tensor,
)
from generators.backends.base import Completion, HFText, StepHook
from generators.backends.torch_attention import attn_implementation
from generators.backends.torch_decode import decode, grouped, prefill
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

    def _tick(self) -> None:
        """Before each decode step: the heartbeat (``alive``), then the configured stand-in latency."""
        self.alive()
        if self.cfg.step_latency_s:
            time.sleep(self.cfg.step_latency_s)

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, on_step: StepHook | None = None
    ) -> list[list[Completion]]:
        self._check_context(max(len(p) for p in prompts), sampling.max_tokens)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        version = on_step() if on_step is not None else -1
        batch = prefill(self.model, prompts, sampling.n, self.pad_token_id, self.device)
        out = decode(
            self.model, batch, sampling, gen, self.eos_token_id, self.pad_token_id, self._tick, on_step, version
        )
        return grouped(out, sampling.n, with_versions=on_step is not None)
