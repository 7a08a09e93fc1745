"""Who may train the model through the OpenAI-compatible endpoint (issue 44), tried against `relay up` as a
local attacker did: the endpoint's URL from the dashboard's public events, then requests without the run's
key, and the POST a web page on another site can send without a preflight (`text/plain`). And what the
operator gets with the key (docs/openai-endpoint.md): the weight version that sampled each answer, the
behaviour log-probs on request, the prompt's token count, a clear 400 for chat on a model without a chat
template (the built-in tiny model has none).

One `relay up` (the tiny model, one generator, `generator.openai.enabled = true`) serves every test; about a
minute on 2 cores."""

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.services import ROOT, child_env, metric_value, wait_until

pytestmark = pytest.mark.slow

ORIGIN = {"Origin": "http://attacker.example"}
START_S = 720  # relay up to an answering endpoint: ~40 s on a quiet machine, 5 minutes seen on a loaded one


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oa")
    out = tmp / "up.out"
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "up",
        "--runs-dir",
        str(tmp / "runs"),
        "--run-id",
        "oa",
        "--steps",
        "100000",
        "--generators",
        "1",
        "--dashboard-port",
        "0",
        "--no-progress",
        "--set",
        "generator.openai.enabled=true",
        "--set",
        "generator.openai.group_size=1",
        "--set",
        "broker.eval.every_versions=0",
    ]
    with out.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp / "runs" / "oa"
    deadline = time.monotonic() + START_S

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    try:
        dash = wait_until(
            lambda: re.search(r"dashboard at (http://127\.0\.0\.1:\d+)/", out.read_text()),
            timeout=left(),
            what=f"relay up's dashboard:\n{out.read_text()[-3000:]}",
        ).group(1)

        def endpoint_event():  # what anyone who reaches the dashboard reads: the endpoint's URL
            try:
                entries = httpx.get(f"{dash}/api/history/events", timeout=5).json()["entries"]
            except httpx.HTTPError:
                return None
            return next((e for e in entries if e["kind"] == "openai_endpoint"), None)

        event = wait_until(
            endpoint_event, timeout=left(), what=f"the openai_endpoint event:\n{out.read_text()[-3000:]}"
        )
        url = event["url"]
        key = (run_dir / "secrets" / "openai.key").read_text().strip()
        auth = {"Authorization": f"Bearer {key}"}
        # serving a version (before, a call is answered 503)
        wait_until(
            lambda: (
                httpx.get(f"{url}/models", headers=auth, timeout=10).status_code == 200
                and httpx.post(
                    f"{url}/completions", json={"prompt": "1=", "max_tokens": 1}, headers=auth, timeout=30
                ).status_code
                == 200
            ),
            timeout=left(),
            what="the endpoint answering",
        )
        targets = httpx.get(f"{dash}/api/prometheus/targets", timeout=5).json()
        metrics = next(
            f"http://{t}/metrics" for g in targets for t in g["targets"] if g["labels"].get("service") == "generator"
        )
        yield {
            "proc": proc,
            "out": out,
            "run_dir": run_dir,
            "url": url,
            "event": event,
            "key": key,
            "auth": auth,
            "metrics": metrics,
        }
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _metrics(run) -> str:
    return httpx.get(run["metrics"], timeout=10).text


def test_relay_up_keys_the_endpoint_and_a_request_without_the_key_trains_nothing(run):
    url, key, run_dir = run["url"], run["key"], run["run_dir"]
    text = run["out"].read_text()
    assert f"the OpenAI endpoint's key for this run is in {run_dir / 'secrets' / 'openai.key'}" in text, text
    assert len(key) >= 32 and key not in text  # never printed
    assert stat.S_IMODE(os.stat(run_dir / "secrets" / "openai.key").st_mode) == 0o600
    for cfg in (run_dir / "config").iterdir():  # it reaches the generator through its environment only
        assert key not in cfg.read_text(), cfg
    assert run["event"]["auth"] == "bearer"

    before = _metrics(run)
    session = {"X-Relay-Session": "stranger", "X-Relay-Group": "stranger"}
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Bearer guessed"}, {"Authorization": key}):
        r = httpx.post(
            f"{url}/completions", json={"prompt": "5=", "max_tokens": 4}, headers={**headers, **session}, timeout=30
        )
        assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{url}/relay/sessions/stranger/reward", json={"reward": 1.0}, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert httpx.get(f"{url}/models", headers=headers, timeout=10).status_code == 401
    after = _metrics(run)
    for name, labels in (
        ("relay_generator_openai_sessions_total", {"outcome": "started"}),
        ("relay_generator_openai_tokens_total", {"kind": "sampled"}),
        ("relay_generator_openai_groups_total", {"outcome": "sent"}),
    ):
        assert metric_value(after, name, **labels) == metric_value(before, name, **labels), name  # nothing trained
    assert (
        metric_value(after, "relay_generator_openai_requests_total", endpoint="completions", outcome="unauthorized")
        == 4
    )

    # with the key, the same session is sampled and its group (of 1) goes to the broker, the reward marked
    # as the caller's
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
    got = client.completions.create(model="relay", prompt="5=", max_tokens=4, extra_headers=session)
    assert got.model_extra["relay"]["session"] == "stranger"
    r = httpx.post(f"{url}/relay/sessions/stranger/reward", json={"reward": 1.0}, headers=run["auth"], timeout=30)
    assert r.status_code == 200 and r.json()["group_complete"] and r.json()["broker"] == "ok", r.text
    assert metric_value(_metrics(run), "relay_generator_openai_rewards_total", source="caller") == 1


def test_a_cross_site_text_plain_post_is_refused(run):
    """A page the operator opens can POST `text/plain` (or a form) to 127.0.0.1 without a preflight; it cannot
    add the key, and even with it the endpoint reads no body that is not JSON."""
    url, auth = run["url"], run["auth"]
    before = _metrics(run)
    body = json.dumps({"prompt": "5=", "max_tokens": 4})
    session = {"X-Relay-Session": "page"}
    for headers in ({}, auth):
        for ctype in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
            r = httpx.post(
                f"{url}/completions",
                content=body,
                headers={**headers, **ORIGIN, **session, "Content-Type": ctype},
                timeout=30,
            )
            assert r.status_code == (415 if headers else 401), r.text
            assert not any(h.startswith("access-control-") for h in r.headers)
            r = httpx.post(
                f"{url}/relay/sessions/page/reward",
                content='{"reward": 1}',
                headers={**headers, **ORIGIN, "Content-Type": ctype},
                timeout=30,
            )
            assert r.status_code == (415 if headers else 401), r.text
    r = httpx.post(
        f"{url}/completions", content=body, headers={**auth, **session, "Content-Type": "text/plain"}, timeout=30
    )
    assert "application/json" in r.json()["error"]["message"]
    # no CORS: the preflight of a JSON POST gets no allowance
    pre = httpx.request(
        "OPTIONS",
        f"{url}/completions",
        timeout=10,
        headers={
            **ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.status_code >= 400 and not any(h.startswith("access-control-") for h in pre.headers)
    after = _metrics(run)
    assert metric_value(after, "relay_generator_openai_sessions_total", outcome="started") == metric_value(
        before, "relay_generator_openai_sessions_total", outcome="started"
    )
    assert metric_value(after, "relay_generator_openai_requests_total", outcome="unsupported_media_type") == 5


def test_responses_carry_the_weight_version_logprobs_and_prompt_tokens(run):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=run["url"], api_key=run["key"], max_retries=0, timeout=60)
    raw = client.completions.with_raw_response.create(model="relay", prompt="123=", max_tokens=4, logprobs=0)
    got = raw.parse()
    version = got.model_extra["relay"]["weight_version"]
    assert isinstance(version, int) and version >= 0 and raw.headers["x-relay-weight-version"] == str(version)
    lp, ids = got.choices[0].logprobs, got.model_extra["relay"]["completion_ids"]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) > 0
    assert all(x <= 0.0 for x in lp.token_logprobs) and lp.text_offset[0] == len("123=")
    assert "".join(t for t, i in zip(lp.tokens, ids) if i != 2) == got.choices[0].text  # 2: the tiny model's EOS
    assert got.usage.prompt_tokens == 5  # <bos> 1 2 3 =, without a session too
    assert got.usage.total_tokens == 5 + got.usage.completion_tokens


def test_chat_on_a_model_without_a_chat_template_says_why(run):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=run["url"], api_key=run["key"], max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="no chat template.*/v1/completions"):
        client.chat.completions.create(model="relay", messages=[{"role": "user", "content": "12="}])
    assert run["proc"].poll() is None
