"""The torch backend's CPU attention for grouped-query models gives transformers' ``sdpa`` output without
copying the keys and values per head: prefill of a left-padded batch, then decode steps on the cache."""

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from generators.backends.torch_attention import NAME, attn_implementation


def test_grouped_query_attention_equals_transformers_sdpa_on_a_padded_batch_and_its_decode_steps():
    config = LlamaConfig(
        vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = LlamaForCausalLM(config).eval()
    assert ref.config._attn_implementation == "sdpa"
    assert attn_implementation(torch.device("cpu")) == NAME
    ours = LlamaForCausalLM._from_config(config, attn_implementation=NAME).eval()
    assert ours.config._attn_implementation == NAME
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(3, 50, (3, 7))
    attn = torch.ones_like(ids)
    attn[0, :3] = 0  # left padding of different lengths
    attn[1, :1] = 0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    caches = {m: DynamicCache(config=config) for m in (ref, ours)}
    with torch.no_grad():
        out = {m: m(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=caches[m]) for m in caches}
        keep = attn.bool()
        torch.testing.assert_close(out[ours].logits[keep], out[ref].logits[keep], atol=1e-5, rtol=0)
        nxt = pos[:, -1:] + 1
        for _ in range(3):
            tok = out[ref].logits[:, -1].argmax(-1, keepdim=True)
            attn = torch.cat([attn, torch.ones_like(tok)], 1)
            out = {
                m: m(input_ids=tok, attention_mask=attn, position_ids=nxt, past_key_values=caches[m]) for m in caches
            }
            torch.testing.assert_close(out[ours].logits, out[ref].logits, atol=1e-5, rtol=0)
            nxt = nxt + 1
