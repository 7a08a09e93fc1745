"""docs/rewards.md's Python plugin example works as written, and a plugin installed with a
`relay.rewards` entry point is found by the service."""

import asyncio
import re
import sys
import textwrap

import pytest

from reward_service import plugins as P
from reward_service.config import RewardConfig
from reward_service.scoring import Scorer
from tests.support.services import ROOT

DOC = (ROOT / "docs" / "rewards.md").read_text()


def test_the_documented_python_plugin_scores_as_documented():
    code = re.search(r"```python\n(# my_rewards/keyword.py\n.*?)```", DOC, re.S).group(1)
    ns: dict = {}
    try:
        exec(compile(code, "docs/rewards.md", "exec"), ns)
        s = Scorer(
            RewardConfig(plugins={"kw": {"type": "keyword", "options": {"word": "Paris"}}}, task_plugins={"qa": "kw"})
        )
        out = asyncio.run(
            s.score(
                [
                    P.Item("Capital of France?", "Paris.", task="qa"),
                    P.Item("Capital of France?", "Lyon", task="qa"),
                    P.Item("q", "", task="qa"),
                ]
            )
        )
        assert [(r.score, r.plugin) for r in out[:2]] == [(1.0, "kw"), (0.0, "kw")]
        assert out[0].details == {"hit": 1.0} and out[2].reason.startswith("empty_completion")
    finally:
        P.REGISTRY.pop("keyword", None)


def test_entry_point_plugins_are_discovered(tmp_path, monkeypatch):
    (tmp_path / "relay_ep_demo.py").write_text(
        textwrap.dedent("""
        from reward_service.plugins import Result, RewardPlugin

        class Always(RewardPlugin):
            async def score(self, items):
                return [Result(0.25) for _ in items]
    """)
    )
    dist = tmp_path / "relay_ep_demo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: relay-ep-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[relay.rewards]\nalways_quarter = relay_ep_demo:Always\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "always_quarter" in P.load_entry_point_plugins()
        out = asyncio.run(Scorer(RewardConfig(task_plugins={"t": "always_quarter"})).score([P.Item("", "x", task="t")]))
        assert out[0].score == 0.25 and out[0].plugin == "always_quarter"
    finally:
        P.REGISTRY.pop("always_quarter", None)
        sys.modules.pop("relay_ep_demo", None)


def test_a_non_plugin_entry_point_is_refused(tmp_path, monkeypatch):
    (tmp_path / "relay_ep_bad.py").write_text("def not_a_class():\n    pass\n")
    dist = tmp_path / "relay_ep_bad-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: relay-ep-bad\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[relay.rewards]\nbad = relay_ep_bad:not_a_class\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match="is not a subclass of RewardPlugin"):
        P.load_entry_point_plugins()
    sys.modules.pop("relay_ep_bad", None)
