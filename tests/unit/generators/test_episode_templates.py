"""Rendering the environment's replies for a tokenizer with a chat template, and the template-drift
check (generators/episodes.py, generators/chat_render.py): a template that renders the conversation as it was sampled counts no
drift; one that rewrites earlier turns is counted and flagged on the sample. The tokenizer is the
tiny model's (tool vocabulary) with a chat template set here; the model is a fake that samples fixed turns."""

from __future__ import annotations


from broker.protocol.messages import PromptEntry
from generators.backends.base import Completion
from generators.config import SamplingConfig
from generators.chat_render import ChatRenderer, make_renderer
from generators.episodes import EpisodeLimits, EpisodeRunner, EpisodeStats
from learner.tiny_model import build_tokenizer
from tests.support.smollm2 import smollm2_tokenizer
from tests.support.episode_envs import CountEnv

FAITHFUL = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<bos>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}<eos>"
    "{% else %}<tool_response>{{ m['content'] }}</tool_response>{% endif %}{% endfor %}"
)
# renders every assistant turn but the last one reversed: a template that rewrites earlier turns
REWRITING = FAITHFUL.replace(
    "{{ m['content'] }}<eos>", "{{ m['content'] if loop.last else m['content']|reverse|join }}<eos>"
)


class FixedTurns:
    """A fake engine whose every turn is ``text`` (+ <eos> unless ``cut``), as token ids."""

    name = "fake"

    def __init__(self, tokenizer, text: str, cut: bool = False):
        self.tokenizer = tokenizer
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([] if cut else [tokenizer.eos_token_id])
        self.cut = cut

    def encode(self, text):
        return self.tokenizer(text)["input_ids"]

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompts, sampling, seed, on_step=None):
        return [[Completion(list(self.ids), [-0.1] * len(self.ids), "length" if self.cut else "stop")] for _ in prompts]


def episodes(template: str, text: str = "12", cut: bool = False):
    tok = build_tokenizer(tools=True)
    tok.chat_template = template
    backend = FixedTurns(tok, text, cut)
    renderer = make_renderer(backend)
    assert isinstance(renderer, ChatRenderer)
    stats = EpisodeStats()
    r = EpisodeRunner(
        backend,
        lambda: CountEnv(done_after=3),
        SamplingConfig(n=2, max_tokens=8),
        EpisodeLimits(4, 48, 30.0),
        lambda: 0,
        renderer=renderer,
        stats=stats,
    )
    p = PromptEntry("7*8=", "12", "count")
    ids = r.prompt_ids(p)
    [group] = r.run([p], [ids], seed=0)
    return tok, ids, group, stats


def test_a_faithful_template_gives_the_replies_tokens_and_counts_no_drift():
    tok, ids, group, stats = episodes(FAITHFUL)
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>7*8="  # the prompt: the template's rendering
    c = group[0]
    text = tok.decode(c.token_ids, skip_special_tokens=False)
    assert text == "12<eos><tool_response>1</tool_response>12<eos><tool_response>2</tool_response>12<eos>"
    assert [t for t, m in zip(c.token_ids, c.trainable) if m] == (
        tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ) * 3
    assert stats.template_drift == 0 and all("template_drift" not in c.episode for c in group)


def test_a_turn_cut_by_max_tokens_is_closed_as_the_template_closes_it_as_context():
    tok, _, group, stats = episodes(FAITHFUL, cut=True)
    c = group[0]
    assert tok.decode(c.token_ids, skip_special_tokens=False).startswith("12<eos><tool_response>1</tool_response>")
    assert c.trainable[:4] == [1, 1, 0, 0]  # the template's <eos> after the cut turn is context, not trained
    assert stats.template_drift == 0


def test_a_template_that_rewrites_earlier_turns_is_counted_as_drift_and_flagged_on_the_sample():
    tok, _, group, stats = episodes(REWRITING)
    assert stats.template_drift == 2
    assert all(c.episode.get("template_drift") is True for c in group)
    # the sample keeps the tokens that were sampled (never silently re-rendered)
    assert tok.decode(group[0].token_ids, skip_special_tokens=False).startswith("12<eos>")


def test_smollm2_chat_template_multi_turn_episode_has_no_drift():
    """SmolLM2-135M-Instruct's real tokenizer and chat template (its GGUF ships with the test extra)."""
    tok = smollm2_tokenizer()
    backend = FixedTurns(tok, '<tool_call>{"name": "calc", "arguments": {"expr": "7*8"}}</tool_call>')
    backend.ids = tok(backend.tokenizer.decode(backend.ids[:-1]), add_special_tokens=False)["input_ids"] + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    stats = EpisodeStats()
    r = EpisodeRunner(
        backend,
        lambda: CountEnv(done_after=2),
        SamplingConfig(n=1, max_tokens=64),
        EpisodeLimits(3, 512, 30.0),
        lambda: 0,
        renderer=make_renderer(backend),
        stats=stats,
    )
    p = PromptEntry("What is 7*8?", "56", "count")
    [[c]] = r.run([p], [r.prompt_ids(p)], seed=0)
    text = tok.decode(c.token_ids, skip_special_tokens=False)
    assert "<|im_end|>\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>assistant\n" in text
    assert c.episode["turns"] == 2 and stats.template_drift == 0
    # a byte-level tokenizer spells any reply: none counted unspellable (the tiny model's: test_episodes.py)
    assert stats.unspellable == 0 and r.renderer.misspelled("higher, or lower? 🙂") is None
