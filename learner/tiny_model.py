"""The built-in tiny model: a random-init Qwen2 (or, for vLLM, a Llama) with a 15-symbol tokenizer,
built locally.

Vocabulary: <pad> <bos> <eos> 0-9 + =. A prompt "473=" encodes to [<bos>, 4, 7, 3, =]; the model
answers digits then <eos>. Built deterministically from a seed, saved as a standard Hugging Face
folder (config.json, tokenizer files, model.safetensors) that transformers and vLLM load as is.

With ``tools`` (tasks that call tools, such as ``calc``), five symbols are appended after those 15:
``*`` ``<tool_call>`` ``</tool_call>`` ``<tool_response>`` ``</tool_response>``. They are ordinary
(not special) tokens, so decoding keeps them and the environment sees the tool call: the model's
turn ``<tool_call>7*8</tool_call><eos>`` decodes to ``"<tool_call>7*8</tool_call>"``. Without
``tools`` the vocabulary, and so the model built from a seed, is exactly the 15-symbol one.
"""

from __future__ import annotations

from pathlib import Path

SYMBOLS = ["<pad>", "<bos>", "<eos>", *"0123456789", "+", "="]
MAX_POSITIONS = 64  # the tiny model's context: prompt and completion together (relay up checks they fit)
TOOL_SYMBOLS = ["*", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def symbols(tools: bool = False) -> list[str]:
    """The vocabulary in id order: the 15 symbols, then the tool symbols when ``tools``."""
    return SYMBOLS + TOOL_SYMBOLS if tools else list(SYMBOLS)


def build_tokenizer(tools: bool = False):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(symbols(tools))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    pattern = r"</?tool_(?:call|response)>|[0-9+=*]" if tools else r"[0-9+=]"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    if tools:  # the markers as added (not special) tokens too: matched whole whatever tokenizer class loads the
        # folder (transformers 5 loads it as Qwen2's byte-level BPE, which would split "<tool_call>" into characters)
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_SYMBOLS[1:]])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", padding_side="left"
    )


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    vllm_compatible: bool = False,
    tools: bool = False,
) -> Path:
    """Write a random-init tiny model and its tokenizer to ``out_dir``; return the path.

    Default: a Qwen2 with heads of ``hidden // heads`` (133k parameters). vLLM's CPU attention
    supports head sizes 32, 64, 80, ... only, and vLLM's Qwen2 derives the head size from
    hidden / heads, so ``vllm_compatible`` builds a Llama with heads of at least 32 instead (166k
    parameters by default). Both learn the copy task; the Qwen2 one did so more reliably here
    (docs/generators.md), which is why it stays the default for the torch backend. ``tools`` appends the
    tool symbols to the vocabulary (tasks whose environment calls tools, e.g. ``calc``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(tools)
    common = dict(
        vocab_size=len(symbols(tools)),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    if vllm_compatible:
        config, cls = LlamaConfig(head_dim=max(32, hidden // heads), **common), LlamaForCausalLM
    else:
        config, cls = Qwen2Config(head_dim=hidden // heads, **common), Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
