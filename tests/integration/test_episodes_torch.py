"""Multi-turn episodes with the real torch backend and the tiny model with its tool vocabulary: the
environment's replies are rendered as ``<tool_response>..</tool_response>`` context tokens, and the
model tokens' behaviour log-probs are those the learner recomputes over the whole episode (token in,
token out: nothing was re-tokenised)."""

from __future__ import annotations

import torch

from broker.protocol.messages import PromptEntry
from generators.config import SamplingConfig, TorchBackendConfig
from generators.chat_render import check_tool_vocabulary, make_renderer
from generators.episodes import EpisodeLimits, EpisodeRunner, EpisodeStats
from learner.tiny_model import build_tiny_model, build_tokenizer
from tests.support.episode_envs import CountEnv
from tests.support.models import recompute_logprobs


def test_tiny_tools_model_runs_two_turn_episodes_token_in_token_out(tmp_path):
    path = build_tiny_model(tmp_path / "m", tools=True)
    backend = TorchBackendConfig().build()
    backend.load(str(path))
    renderer = make_renderer(backend)
    check_tool_vocabulary(renderer, backend)  # the tool markers are single tokens of this vocabulary
    versions = iter(range(1, 100))
    stats = EpisodeStats()
    r = EpisodeRunner(
        backend,
        lambda: CountEnv(done_after=2),
        SamplingConfig(n=4, max_tokens=6),
        EpisodeLimits(max_turns=3, max_tokens=32, timeout_s=60),
        lambda: next(versions),
        renderer=renderer,
        stats=stats,
    )
    prompts = [PromptEntry("7*8=", "56", "calc"), PromptEntry("3*4=", "12", "calc")]
    ids = [r.prompt_ids(p) for p in prompts]
    assert ids[0] == [1, 10, 15, 11, 14]  # <bos> 7 * 8 =
    groups = r.run(prompts, ids, seed=3)
    reply = build_tokenizer(tools=True)("<tool_response>1</tool_response>", add_special_tokens=False)["input_ids"]
    assert reply == [18, 4, 19]
    model = backend.model
    for pid, group in zip(ids, groups):
        assert len(group) == 4
        for c in group:
            assert c.episode["turns"] == 2 and c.episode["tool_calls"] == 2 and c.env_reward is not None
            ctx = [t for t, m in zip(c.token_ids, c.trainable) if not m]
            assert ctx == reply  # the tool's reply, as context
            first = c.trainable.index(0)
            assert set(c.versions[: first + 3]) == {1} and set(c.versions[first + 3 :]) == {2}
            assert c.answer_ids == c.token_ids[first + 3 :]  # the last model turn
            # the learner's recomputation over the whole episode matches at every model token
            lp = recompute_logprobs(model, pid, c.token_ids)
            got = torch.tensor(c.logprobs)
            mask = torch.tensor(c.trainable, dtype=torch.bool)
            assert torch.allclose(lp[mask], got[mask], atol=1e-4)
            assert (got[~mask] == 0).all()
    assert r.rounds == 2 and stats.episodes == 8 and stats.tool_calls == {"count": 16}


def test_the_default_tiny_model_is_unchanged_by_the_tool_vocabulary(tmp_path):
    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b", tools=True)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    c = build_tiny_model(tmp_path / "c")
    assert (a / "model.safetensors").read_bytes() == (c / "model.safetensors").read_bytes()
    tok = build_tokenizer()
    assert len(tok) == 15 and tok("473=")["input_ids"] == [1, 7, 10, 6, 14]
    tools = build_tokenizer(tools=True)
    assert len(tools) == 20 and tools("473=")["input_ids"] == [1, 7, 10, 6, 14]
    assert (
        tools.decode(tools("<tool_call>7*8</tool_call>", add_special_tokens=False)["input_ids"])
        == "<tool_call>7*8</tool_call>"
    )
