"""`relay up` checks the whole run before it starts anything (deploy/launcher/preflight.py): each
start-up mistake a new user makes fails in seconds with one line naming the problem and its fix,
exit code 2, and no service started (no run folder, so no service logs). A service that still fails
at start-up is not restarted: the run stops with its error last (deploy/launcher/supervisor.py)."""

import json
import socket
import time

import pytest

from tests.support.services import ROOT, child_env, children_cpu, relay


def _data(tmp_path, rows: int = 3):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": str(100 + i), "answer": str(100 + i)}) + "\n" for i in range(rows)))
    return path


def _no_weights(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text('{"model_type": "qwen2"}')
    return ["--model", str(m)]


def _hidden_vllm(tmp_path, env):
    # vLLM is installed here: a sitecustomize that marks it absent, as on a machine without it
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    env["PYTHONPATH"] = f"{shim}:{env.get('PYTHONPATH', ROOT)}"
    return ["--backend", "vllm"]


def _unset_token(tmp_path, env):
    env.pop("PREFLIGHT_TEST_JUDGE_KEY", None)
    return [
        "--set",
        'reward.plugins.judge={"type": "judge", "options": {"base_url": "http://127.0.0.1:9", '
        '"model": "m", "token_env": "PREFLIGHT_TEST_JUDGE_KEY"}}',
    ]


def _dataset(rows: list[dict] | None = None, **fields):
    def args(tmp_path, env):
        path = _data(tmp_path)
        if rows is not None:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = ["--set", "broker.eval.every_versions=0", "--set", f"broker.dataset.path={path}"]
        return out + [a for k, v in fields.items() for a in ("--set", f"broker.dataset.{k}={v}")]

    return args


def _set(*pairs: str):
    return lambda tmp_path, env: [a for p in pairs for a in ("--set", p)]


def _own_keys(*fields: str, extra: tuple[str, ...] = ()):
    """Ingest keys of one's own (docs/protocol.md 12.4), given for ``fields`` only."""

    def args(tmp_path, env):
        from broker.protocol.ingest_auth import write_ingest_keys

        k = write_ingest_keys(tmp_path / "keys", ["pool"], patterns={"pool": "gen-*"})
        files = {
            "broker.ingest_key_file": k["broker_key_file"],
            "broker.ingest_clients_file": k["clients_file"],
            "generator.ingest_key_file": k["generators"]["pool"],
            "generator.broker_public_key_file": k["broker_public_key_file"],
        }
        return [a for f in fields for a in ("--set", f"{f}={files[f]}")] + list(extra)

    return args


# the "reverse the word" dataset: on the tiny model every prompt became <bos> and trained at reward 0
WORDS = [{"prompt": "123", "answer": "321"}] * 3 + [
    {"prompt": f"reverse the word {w}", "answer": w[::-1]} for w in ("apple", "pear")
]


MISTAKES = {
    "dataset path missing": (
        lambda tmp_path, env: [
            "--set",
            "broker.eval.every_versions=0",
            "--set",
            f"broker.dataset.path={tmp_path / 'nope.jsonl'}",
        ],
        ["nope.jsonl does not exist", "dataset.path"],
    ),
    "field not in the file": (
        _dataset(prompt_field="question"),
        ["no field 'question'", "fields: answer, prompt", "prompt_field"],
    ),
    "start past the end": (_dataset(start=10), ["has 3 rows", "dataset.start = 10", "start below 3"]),
    "chat template asked for, none there": (_dataset(chat_template="always"), ["has no chat template", "'never'"]),
    "a system prompt the tiny model cannot spell": (
        _dataset(system_prompt="Think step by step."),
        ["system_prompt does not survive the tokenizer", "knows only digits"],
    ),
    "model folder without weights": (
        lambda tmp_path, env: _no_weights(tmp_path),
        ["has a config.json but no weights", "download the whole model"],
    ),
    "vllm not installed": (_hidden_vllm, ["vllm backend needs the vllm package", "--backend torch"]),
    "unset token_env": (
        _unset_token,
        ["reward.plugins.judge", "'PREFLIGHT_TEST_JUDGE_KEY'", "not set", "export PREFLIGHT_TEST_JUDGE_KEY="],
    ),
    # once: 2 minutes of no step, then a Ctrl-C that took 49 s
    "max_tokens past the model's context": (
        _set("generator.sampling.max_tokens=4096"),
        ["generator.sampling.max_tokens = 4096", "context of 64 positions", "set it below 64"],
    ),
    "max_tokens past the model's context and the learner's micro-batch": (  # the context named, not micro_batch
        _set("generator.sampling.max_tokens=9000"),
        ["generator.sampling.max_tokens = 9000", "context of 64 positions", "set it below 64"],
    ),
    "a task's prompt and max_tokens past the context": (
        _set("generator.sampling.max_tokens=60"),
        ["copy task's longest prompt (6 tokens)", "lower generator.sampling.max_tokens to 58 or less"],
    ),
    "max_prompt_tokens + max_tokens past the context": (
        _dataset(max_prompt_tokens=64),
        ["broker.dataset.max_prompt_tokens (64)", "set broker.dataset.max_prompt_tokens to 56 or less"],
    ),
    "a prompt the tiny model cannot spell": (
        _dataset(WORDS, reference_field="answer"),
        ["row 3's prompt does not survive the tokenizer", "'reverse the word apple'", "knows only digits"],
    ),
    "a reference the tiny model cannot spell": (
        _dataset([{"prompt": "123", "answer": "one two three"}], reference_field="answer"),
        ["row 0's reference 'one two three' does not survive the tokenizer"],
    ),
    "a learning rate of 1000": (
        _set("learner.optim.lr=1000"),
        ["learner.optim.lr = 1000 is no learning rate", "set learner.optim.lr below 1"],
    ),
    "a learning rate of 1e30": (_set("learner.optim.lr=1e30"), ["learner.optim.lr = 1e+30 is no learning rate"]),
    # before, the generators' groups went unanswered (a refused handshake) or were rejected wrong_generator
    "an allow-list of one's own without the generators' key": (
        _own_keys("broker.ingest_clients_file"),
        ["only broker.ingest_clients_file is your own", "docs/protocol.md section 12"],
    ),
    "a broker key of one's own the generators do not know": (
        _own_keys("broker.ingest_key_file"),
        ["only broker.ingest_key_file is your own"],
    ),
    "--producers with an allow-list of one's own": (
        _own_keys(
            "broker.ingest_key_file",
            "broker.ingest_clients_file",
            "generator.ingest_key_file",
            "generator.broker_public_key_file",
            extra=("--producers", "1"),
        ),
        ["--producers adds each producer's key", "add your producers' keys"],
    ),
    "an environment on the tiny model without its tools": (
        lambda tmp_path, env: ["--task", "calc", "--set", "learner.tiny.tools=false"],
        ["generator.episodes.env = 'calc'", "learner.tiny.tools = true"],
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_start_up_mistake_fails_at_once_with_one_line_and_nothing_started(tmp_path, mistake):
    make_args, needles = MISTAKES[mistake]
    env = child_env()
    args = make_args(tmp_path, env)
    runs = tmp_path / "runs"
    t0, cpu0 = time.monotonic(), children_cpu()
    res = relay("up", *args, "--runs-dir", str(runs), "--run-id", "r", "--dashboard-port", "0", env=env, timeout=60)
    elapsed, cpu = time.monotonic() - t0, children_cpu() - cpu0
    assert res.returncode == 2, res.stdout + res.stderr
    # at once: ~1-2 s of CPU alone (the tokenizer checks the most); the wall bound leaves room for tests
    # running beside it and still fails a launcher that waits on a service (a learner takes ~10 s to come up)
    assert cpu < 5.0 and elapsed < 10.0, f"{mistake}: took {elapsed:.1f} s ({cpu:.1f} s of CPU)\n{res.stderr}"
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("relay up: error: "), res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    # nothing started: no run folder (so no service logs, no pids.json), no runs/latest
    assert not runs.exists(), sorted(p.name for p in runs.rglob("*"))


def test_a_port_the_user_set_that_is_taken_is_refused_before_start(tmp_path):
    """relay up binds the services' ports itself before starting them (deploy/launcher/listeners.py), so a
    port the user set that another process holds is found then: one line naming the setting, exit 2, no
    run folder (before, the reward service died on it at start-up)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        res = relay(
            "up",
            "--set",
            f"reward.port={port}",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--run-id",
            "r",
            "--dashboard-port",
            "0",
            "--no-progress",
            timeout=60,
        )
        elapsed = time.monotonic() - t0
    assert res.returncode == 2 and elapsed < 5, (res.returncode, elapsed, res.stderr)
    assert res.stderr.strip().splitlines() == [
        f"relay up: error: cannot listen on 127.0.0.1:{port} (reward.port): "
        f"Address already in use; pick another port, or leave it out and relay "
        f"up picks a free one"
    ], res.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # the learner gets as far as loading the weights: about 20 s
def test_a_learner_that_cannot_load_its_weights_is_not_restarted_and_publishes_nothing(tmp_path):
    """Weights present but unreadable pass the file checks; the learner fails loading them, before its
    first version: it is not restarted (it would fail the same way every time; each restart used to publish
    another initial version), and the run stops at once with the learner's own error as the last line.
    (This was also shown with a reward service whose port was taken; relay up now holds the ports itself
    and refuses a taken one before anything starts, below.)"""
    from learner.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    res = relay(
        "up",
        "--model",
        str(model),
        "--runs-dir",
        str(tmp_path / "runs"),
        "--run-id",
        "r",
        "--dashboard-port",
        "0",
        "--no-progress",
        timeout=180,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "restart 1/" not in res.stderr, res.stderr
    assert "before it first became healthy" in res.stderr.strip().splitlines()[-2], res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("relay up: error: learner failed at start-up: "), res.stderr
    summary = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert summary["restarts"]["learner"] == 0 and summary["versions_published"] == 0 and summary["steps"] == 0
