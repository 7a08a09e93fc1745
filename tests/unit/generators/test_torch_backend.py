"""The torch backend's group prefill: each prompt is computed once and its KV cache copied to the
n samples of its group. The samples must be exactly those of n separate copies of the prompt."""

import pytest
import torch

from generators.backends.torch import TorchBackend
from generators.config import SamplingConfig, TorchBackendConfig


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from learner.tiny_model import build_tiny_model

    d = tmp_path_factory.mktemp("tiny")
    build_tiny_model(d, seed=0)
    b = TorchBackend(TorchBackendConfig())
    b.load(str(d))
    return b


def test_a_group_shares_its_prompts_prefill_and_samples_as_if_each_row_had_its_own(backend):
    prompts = [backend.encode("473="), backend.encode("12+7=")]  # different lengths: left padding differs too
    sampling = SamplingConfig(n=3, temperature=1.0, top_k=5, max_tokens=6)
    grouped = backend.generate(prompts, sampling, seed=7)
    rows = backend.generate([p for p in prompts for _ in range(3)], sampling.model_copy(update={"n": 1}), seed=7)
    assert [len(g) for g in grouped] == [3, 3]
    flat = [c for g in grouped for c in g]
    for a, (b,) in zip(flat, rows):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert len({tuple(c.token_ids) for c in grouped[0]}) > 1, "the samples of a group must differ"


def test_sampling_raises_no_deprecation_warning(backend):
    """Every decode step passes the KV cache under the name the installed transformers wants: with the
    old name, transformers 5.2x warns on each call (a generator's log had 99 ``FutureWarning:
    past_key_values`` lines per 100 steps)."""
    import warnings

    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        groups = backend.generate([backend.encode("473=")], sampling, seed=3)
    assert len(groups[0]) == 2


def test_a_bf16_sharded_version_loads_into_an_fp32_engine(tmp_path):
    """A version published in bf16, in shards with the Hugging Face index (learner/publish.py), loads into
    the fp32 torch backend, first load and in-place update: the engine keeps its dtype and holds the
    published values."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.publish import snapshot, write_safetensors
    from learner.tiny_model import build_tiny_model

    base = build_tiny_model(tmp_path / "base", seed=1)
    model = AutoModelForCausalLM.from_pretrained(base)
    versions = []
    for v in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        state = snapshot(model.state_dict(), v, torch.bfloat16, tied=model.config.tie_word_embeddings)
        out = tmp_path / f"v{v}"
        out.mkdir()
        model.config.save_pretrained(out)
        AutoTokenizer.from_pretrained(base).save_pretrained(out)
        assert len(write_safetensors(out, state, shard_bytes=64 * 1024)) > 1  # sharded
        versions.append((out, state))
    b = TorchBackend(TorchBackendConfig())  # float32
    for i, (path, state) in enumerate(versions):
        b.load(str(path)) if i == 0 else b.update_weights(str(path))
        live = b.model.state_dict()
        assert all(t.dtype == torch.float32 for t in live.values() if t.is_floating_point())
        for k, t in state.items():
            assert torch.equal(live[k], t.float()), k


def test_the_backend_shows_a_sign_of_life_at_every_decode_step(backend):
    """The generator sets ``alive`` to its (rate-limited) heartbeat: a batch decoding for minutes is busy, not
    hung, for relay up's --hang-after."""
    calls = []
    backend.alive = lambda: calls.append(1)
    try:
        out = backend.generate([backend.encode("473=")], SamplingConfig(n=2, temperature=1.0, max_tokens=6), seed=3)
    finally:
        del backend.alive  # the class's no-op again
    steps = max(len(c.token_ids) for c in out[0])
    assert len(calls) == steps >= 1


def test_step_latency_adds_its_wait_to_every_decode_step_and_changes_no_sample(backend):
    """``step_latency_s`` (relay bench async_speedup's stand-in for a GPU engine) waits at each decode step,
    and the samples are those of the engine without it."""
    import time

    prompts = [backend.encode("473=")]
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=6)
    plain = backend.generate(prompts, sampling, seed=3)
    backend.cfg = backend.cfg.model_copy(update={"step_latency_s": 0.05})
    try:
        t0 = time.perf_counter()
        slow = backend.generate(prompts, sampling, seed=3)
        t_slow = time.perf_counter() - t0
    finally:
        backend.cfg = backend.cfg.model_copy(update={"step_latency_s": 0.0})
    steps = max(len(c.token_ids) for c in slow[0])
    assert t_slow >= 0.05 * steps, (t_slow, steps)  # one decode step per token of the longest sample
    assert [c.token_ids for c in slow[0]] == [c.token_ids for c in plain[0]]


def test_rows_that_stop_early_leave_the_decode_batch_and_the_others_keep_their_exact_log_probs(backend):
    """A finished row is dropped from the decode batch and its KV cache (once a quarter of the batch has
    finished): the rows left must still sample from their own prompt and tokens. Each completion's log-probs
    are those of the model run on the prompt and that completion alone (teacher forcing), its finish reason
    and length are right, and the EOS ends it."""
    prompts = [backend.encode("473="), backend.encode("12+7=")]
    sampling = SamplingConfig(n=8, temperature=0.8, max_tokens=12)
    first = backend.generate(prompts, sampling, seed=5)
    counts = torch.bincount(torch.tensor([t for g in first for c in g for t in c.token_ids]))
    eos = int(counts.argmax())  # the token the tiny random model samples most: rows stop at many lengths
    saved = backend.eos_token_id
    backend.eos_token_id = eos
    try:
        groups = backend.generate(prompts, sampling, seed=5)
    finally:
        backend.eos_token_id = saved
    flat = [(p, c) for p, g in zip(prompts, groups) for c in g]
    stop_lengths = {len(c.token_ids) for _, c in flat if c.finish_reason == "stop"}
    assert len(stop_lengths) >= 3, "the test needs rows stopping at several steps"
    assert any(c.finish_reason == "length" for _, c in flat), "and rows decoding after others were dropped"
    for prompt, c in flat:
        assert (c.token_ids[-1] == eos) == (c.finish_reason == "stop")
        assert eos not in c.token_ids[:-1]
        assert c.finish_reason == "stop" or len(c.token_ids) == sampling.max_tokens
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = backend.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        want = torch.log_softmax(logits / sampling.temperature, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)


def test_generations_go_up_to_the_models_context_and_no_further(backend):
    """max_tokens follows the model: the tiny model's 64 positions take a 5-token prompt and 59 new tokens
    (the KV cache grows with them); one more is refused, naming the setting and its largest value."""
    prompt = backend.encode("473=")
    assert len(prompt) == 5
    sampling = SamplingConfig(n=1, temperature=1.0, max_tokens=59)
    (done,) = backend.generate([prompt], sampling, seed=1)
    assert 1 <= len(done[0].token_ids) <= 59
    with pytest.raises(ValueError, match=r"5 tokens \+ generator.sampling.max_tokens \(60\).*context of 64.*to 59"):
        backend.generate([prompt], sampling.model_copy(update={"max_tokens": 60}), seed=1)
