"""The built-in tiny model: a random-init Llama with a 15-symbol tokenizer, built locally.

Vocabulary: <pad> <bos> <eos> 0-9 + =. A prompt "473=" encodes to [<bos>, 4, 7, 3, =]; the model
answers digits then <eos>. Built deterministically from a seed, saved as a standard Hugging Face
folder (config.json, tokenizer files, model.safetensors) that transformers and vLLM load as is.
"""

from __future__ import annotations

from pathlib import Path

SYMBOLS = ["<pad>", "<bos>", "<eos>", *"0123456789", "+", "="]


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SYMBOLS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[0-9+=]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", padding_side="left")


def build_tiny_model(out_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                     head_dim: int | None = None) -> Path:
    """Write a random-init tiny Llama model and its tokenizer to ``out_dir``; return the path.

    ``head_dim`` defaults to ``hidden // heads`` but at least 32: vLLM's CPU attention supports head
    sizes 32, 64, 80, ... only, and the same model must serve the torch and vllm backends. (Llama,
    not Qwen2: vLLM's Qwen2 derives the head size from hidden / heads and ignores ``head_dim``.)
    The default (hidden 64, 4 heads of 32, 2 layers) has ~166k parameters."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(SYMBOLS), hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim or max(32, hidden // heads),
        max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
