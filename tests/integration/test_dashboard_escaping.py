"""The dashboard writes what it reads from Redis as text, never as HTML: markup planted in an evaluation
summary, a rejection reason, a reward plugin's name or a generator's refusal reason (anyone who can write
to the run's Redis can plant them) shows as its characters in a real Chromium, and no element, script or
frame of it is created (issue 44: three <img onerror> and an <iframe> were)."""

import json

import pytest
import redis

from broker.protocol.keys import Keys
from broker.protocol.messages import EvalRound
from tests.support.browser import browser  # noqa: F401  (a fixture)
from tests.support.services import start_broker

IMG = '<img src=x onerror="window.__xss=(window.__xss||0)+1">'
FRAME = '<iframe src="javascript:parent.__xss=(parent.__xss||0)+1"></iframe>'


def test_markup_from_redis_renders_as_text(procs, redis_url, tmp_path, browser):  # noqa: F811
    _, http = start_broker(procs, redis_url, tmp_path)
    r, k = redis.Redis.from_url(redis_url), Keys("r")
    # an evaluation round and its summary (broker/prompts/evals.py), every string field holding markup
    r.hset(k.eval_rounds, "7", EvalRound(version=7, prompts=2, greedy=True).encode())
    r.hset(
        k.eval_summaries,
        "7",
        json.dumps(
            {
                "round": 7,
                "complete": True,
                "version": IMG,
                "pass@1": IMG,
                "pass@k": FRAME,
                "k": IMG,
                "mean_reward": FRAME,
                "mean_length": IMG,
                "n_prompts": FRAME,
                "prompts": IMG,
                "reward_failures": IMG,
                "final": IMG,
            }
        ),
    )
    # counters whose names come from Redis: a rejection reason (the failures panel)
    r.hset(k.stats("broker"), f"rejected:{IMG}", 3)
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(http + "/")
    page.wait_for_function(
        "document.querySelectorAll('#eval tbody tr').length === 1 && "
        "document.querySelector('#eval tbody tr td') !== null",
        timeout=30_000,
    )
    page.wait_for_function("document.getElementById('failures').textContent.includes('onerror')", timeout=30_000)
    page.wait_for_timeout(500)  # an image that failed to load would have fired its onerror by now
    row = page.locator("#eval tbody tr")
    text = row.inner_text()
    assert IMG in text and FRAME in text, text  # the characters themselves, shown
    assert IMG in page.locator("#failures").inner_text()
    counts = page.evaluate("""() => ({
        img: document.querySelectorAll('main img').length,
        iframe: document.querySelectorAll('iframe').length,
        frames: window.frames.length,
        xss: window.__xss || 0})""")
    assert counts == {"img": 0, "iframe": 0, "frames": 0, "xss": 0}, counts
    assert not errors, errors
    page.close()


@pytest.mark.parametrize("script", ["dashboard.js"])
def test_the_dashboard_script_never_writes_html(script):
    """The whole script builds its elements (createElement, textContent, append): no innerHTML,
    outerHTML, insertAdjacentHTML or document.write anywhere, so nothing it shows is parsed as markup."""
    from tests.support.services import ROOT

    src = (ROOT / "broker" / "dashboard" / "static" / script).read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in src, sink
