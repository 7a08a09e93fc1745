"""NOT SGLang's kernel: a stand-in, in plain torch, for the one function of SGLang's CPU kernel library
(``sgl_kernel``, built from SGLang's source tree, sgl-kernel/csrc/cpu) that SGLang 0.5.23's CPU engine needs
to serve a small dense model with ``--attention-backend torch_native``: ``assign_req_to_token_pool_cpu``,
which writes freshly allocated KV-cache slots into the request-to-token map. PyPI's ``sgl-kernel`` and
``sglang-kernel`` wheels are CUDA builds, so ``make sglang-env`` copies this package into SGLang's own
environment as ``sgl_kernel`` (docs/generators.md, "SGLang on CPU"). Every other name SGLang
imports from ``sgl_kernel`` at module level (``copy_all_layer_kv_cache_cpu``, ``build_tree_kernel_efficient_cpu``,
... : KV moves, speculative decoding, MoE, quantisation) resolves to a stub that raises NotImplementedError when
called: SGLang's modules import them whatever the model, and Relay's tiny-model server calls none of them (a
call would fail loudly, naming the function).
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+relay-standin"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, *_):
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = out_cache_loc[...]``, the slots of
    request i taken in order from ``out_cache_loc`` (what the C++ kernel of the same name does)."""
    at = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[at : at + n].to(torch.int32)
        at += n


def __getattr__(name: str):
    """A stub for any other kernel function: importable, raises when called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def not_in_standin(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not in Relay's stand-in (tests/support/sgl_kernel_standin): only "
            "assign_req_to_token_pool_cpu is; build SGLang's CPU kernels from its source tree for the rest"
        )

    not_in_standin.__name__ = name
    return not_in_standin
