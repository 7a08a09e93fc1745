"""The OpenAI endpoint's session rules (generators/sessions.py) with a fake chat template: a call that
extends the session's tokens adds only context; a template that rewrites an earlier turn is counted as
drift and the sampled tokens stay the truth; groups complete at group_size rewards; idle sessions drop.
The tool-call parser's tests: test_tool_calls.py."""

import pytest

from generators.sessions import Session, SessionError, Sessions

START, END, NL = 1000, 1001, 1002  # <|im_start|>, <|im_end|> (the model's EOS), "\n"
ROLES = {"system": 2000, "user": 2001, "assistant": 2002, "tool": 2003}


def chatml(rewrite_old_assistant: bool = False):
    """A ChatML-like template on characters. With ``rewrite_old_assistant`` it renders every assistant turn
    but the last in upper case (as templates that strip or rewrite earlier turns do)."""

    def render(messages, add_generation_prompt):
        last_a = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        out = []
        for i, m in enumerate(messages):
            text = m["content"]
            if rewrite_old_assistant and m["role"] == "assistant" and i != last_a:
                text = text.upper()
            out += [START, ROLES[m["role"]], *map(ord, text), END, NL]
        return out + ([START, ROLES["assistant"]] if add_generation_prompt else [])

    return render


def call(s: Session, messages, render, said: str, version=0):
    """One endpoint call: context, then the model "samples" ``said`` + EOS."""
    ctx, drifted = s.context(messages, render, END)
    sampled = [*map(ord, said), END]
    s.record(ctx, sampled, [-0.5] * len(sampled), version, "stop", messages, {"role": "assistant", "content": said})
    return ctx, sampled, drifted


def test_a_conversation_that_extends_its_tokens_adds_only_context_and_trains_only_the_sampled_tokens():
    render, s = chatml(), Session("s", "g")
    m1 = [{"role": "user", "content": "2+3?"}]
    ctx1, samp1, d1 = call(s, m1, render, "calc", version=3)
    assert ctx1 == render(m1, True) and not d1 and s.prompt_len == len(ctx1)
    m2 = m1 + [{"role": "assistant", "content": "calc"}, {"role": "tool", "content": "5"}]
    ctx2, samp2, d2 = call(s, m2, render, "5", version=4)
    assert not d2 and s.template_drift == 0
    # only the template's "\n" after the model's EOS, the tool turn and the next assistant header are new
    assert ctx2 == [NL, START, ROLES["tool"], ord("5"), END, NL, START, ROLES["assistant"]]
    assert s.tokens == ctx1 + samp1 + ctx2 + samp2
    assert s.trainable == [0] * len(ctx1) + [1] * len(samp1) + [0] * len(ctx2) + [1] * len(samp2)
    assert [lp for lp, t in zip(s.logprobs, s.trainable) if not t] == [0.0] * (len(ctx1) + len(ctx2))
    assert s.versions == [3] * (len(ctx1) + len(samp1)) + [4] * (len(ctx2) + len(samp2))
    # the whole sequence is what the template renders for the final conversation: nothing re-tokenised
    assert s.tokens == render(m2 + [{"role": "assistant", "content": "5"}], False)[:-1]


def test_a_template_that_rewrites_an_earlier_turn_counts_drift_and_keeps_the_sampled_tokens():
    render, s = chatml(rewrite_old_assistant=True), Session("s", "g")
    m1 = [{"role": "user", "content": "q"}]
    ctx1, samp1, _ = call(s, m1, render, "ab")
    m2 = m1 + [{"role": "assistant", "content": "ab"}, {"role": "tool", "content": "7"}]
    # the new rendering still has "ab" (it is the last assistant turn): an extension
    ctx2, samp2, d2 = call(s, m2, render, "cd")
    assert not d2
    m3 = m2 + [{"role": "assistant", "content": "cd"}, {"role": "user", "content": "ok"}]
    held = s.tokens[:]
    ctx3, samp3, d3 = call(s, m3, render, "ef")  # now "ab" renders as "AB": not an extension
    assert d3 and s.template_drift == 1
    assert s.tokens[: len(held)] == held  # what was sampled is kept, never replaced by the re-rendering
    assert ord("A") not in s.tokens
    # the new context: the template's "\n" after the model's EOS, then only the new user turn
    assert ctx3 == [NL, START, ROLES["user"], ord("o"), ord("k"), END, NL, START, ROLES["assistant"]]
    assert s.trainable[len(held) :] == [0] * len(ctx3) + [1] * len(samp3)


def test_a_turn_cut_off_by_max_tokens_is_closed_by_the_template_as_context():
    render, s = chatml(rewrite_old_assistant=True), Session("s", "g")
    m1 = [{"role": "user", "content": "q"}]
    ctx1, _ = s.context(m1, render, END)
    s.record(ctx1, [ord("x")], [-1.0], 0, "length", m1, {"role": "assistant", "content": "x"})  # no EOS sampled
    m2 = m1 + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "u"}]
    ctx2, drifted = s.context(m2, render, END)
    assert not drifted and ctx2[:2] == [END, NL]  # the template's end of turn: context, not trained


def _sessions(n=2, idle=10.0):
    now = [0.0]
    ss = Sessions(group_size=n, idle_s=idle, max_sessions=8, clock=lambda: now[0])
    return ss, now


def _run(ss, sid, group, render=chatml(), q="q", said="a"):
    s = ss.begin(sid, group)
    ctx, _, drifted = call(s, [{"role": "user", "content": q}], render, said)
    ss.end(s, drifted)
    return s


def test_a_group_completes_when_all_its_sessions_have_rewards_and_its_prompt_is_their_common_prompt():
    ss, _ = _sessions(n=2)
    a = _run(ss, "a", "g", said="xy")
    _run(ss, "b", "g", said="z")
    assert ss.reward("a", 1.0) is None
    with pytest.raises(SessionError) as e:
        ss.reward("a", 0.5)
    assert e.value.status == 409
    parts = ss.reward("b", 0.0)
    assert parts.prompt_ids == a.tokens[: a.prompt_len] and [s.id for s in parts.sessions] == ["a", "b"]
    ids, trainable, lps, versions = parts.completion(a)
    assert ids == [ord("x"), ord("y"), END] and trainable == [1, 1, 1]
    assert ss.by_id == {} and ss.groups_completed == 1
    with pytest.raises(SessionError) as e:
        ss.reward("a", 1.0)  # sent: forgotten
    assert e.value.status == 404


def test_sessions_with_different_first_prompts_share_their_common_prefix_and_the_rest_is_context():
    ss, _ = _sessions(n=2)
    _run(ss, "a", "g", q="qa")
    b = _run(ss, "b", "g", q="qb")
    ss.reward("a", 1.0)
    parts = ss.reward("b", 0.0)
    assert parts.prompt_ids == [START, ROLES["user"], ord("q")]
    ids, trainable, _, _ = parts.completion(b)
    assert ids[:1] == [ord("b")] and trainable[:5] == [0, 0, 0, 0, 0] and ids == b.tokens[3:]


def test_a_full_group_refuses_another_session_and_sessions_without_a_group_fill_automatic_ones():
    ss, _ = _sessions(n=2)
    _run(ss, "a", "g")
    _run(ss, "b", "g")
    with pytest.raises(SessionError) as e:
        ss.begin("c", "g")
    assert e.value.status == 409
    assert [_run(ss, x, None).group for x in ("p", "q", "r")] == ["auto-0", "auto-0", "auto-1"]
    assert _run(ss, "p", None).group == "auto-0"  # a known session keeps its group


def test_idle_sessions_are_dropped_with_their_group_and_counted():
    ss, now = _sessions(n=2, idle=10.0)
    _run(ss, "a", "g")
    now[0] = 5.0
    _run(ss, "b", "g")
    now[0] = 9.0
    _run(ss, "c", "h")
    now[0] = 12.0  # "a" idle past 10 s: group g cannot complete without it, so "b" goes too; "c" stays
    dropped = ss.drop_idle()
    assert sorted(s.id for s in dropped) == ["a", "b"] and ss.dropped_idle == 2 and list(ss.by_id) == ["c"]
    with pytest.raises(SessionError) as e:
        ss.reward("b", 1.0)
    assert e.value.status == 404


def test_one_call_at_a_time_per_session():
    ss, _ = _sessions()
    ss.begin("a", "g")
    with pytest.raises(SessionError) as e:
        ss.begin("a", "g")
    assert e.value.status == 409
