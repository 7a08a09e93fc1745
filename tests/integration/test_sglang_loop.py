"""`relay up --backend sglang`: the default job with two generators, each with its own real SGLang server
(started by the generator from SGLang's own environment: make test-sglang), learns the default task to the
same reward threshold as `make run` (0.9), every version applied in place (each generator's server process
the same from its first version to its last), the audit's lost 0, and behaviour log-probs that stay those of
the learner's weights."""

import json
import subprocess
import sys

from tests.support.services import ROOT, child_env, relay_up_args
from tests.support.sglang_env import needs_sglang, sglang_python

pytestmark = needs_sglang()

MAX_STEPS = 1000
TARGET, WINDOW = 0.9, 320


def test_relay_up_with_sglang_generators_learns_the_default_task(tmp_path):
    args = relay_up_args(
        tmp_path,
        "s",
        "--backend",
        "sglang",
        steps=MAX_STEPS,
        sets=(
            f"generator.backend.launch.python={sglang_python()}",
            f"learner.target.reward={TARGET}",
            f"learner.target.window={WINDOW}",
        ),
    )
    res = subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=2400,
    )
    run = tmp_path / "s"
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    steps = s["steps"]
    assert s["status"] == "completed" and s["ended"].startswith(f"reached the target reward {TARGET:g} "), s["ended"]
    metrics = [json.loads(line) for line in (run / "learner" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r for m in metrics for r in m["group_rewards"]]
    assert sum(rewards[-WINDOW:]) / WINDOW >= TARGET and s["reward_first"] < 0.5, (s["reward_first"], s["ended"])
    assert s["audit"]["lost"] == 0 and s["audit"]["trained_twice"] == 0
    assert len(s["generators"]) == 2
    servers = set()
    for gid, g in s["generators"].items():
        assert g["backend"] == "sglang" and g["version_applied"] >= steps - 10 and g["updates"] >= steps // 2, (gid, g)
        servers.add(g["engine"]["server_pid"])
    # one server per generator for the whole run: started once (its log says so once), never again
    for gid, g in s["generators"].items():
        assert g["engine"]["servers_started"] == 1, g
        log = next((run / "logs").glob(f"*{gid}*.log")).read_text()
        assert log.count("starting SGLang:") == 1 and log.count("SGLang server ready") == 1, gid
    assert len(servers) == 2 and None not in servers
    fresh = [m["mismatch_kl_fresh"] for m in metrics if m["mismatch_kl_fresh"] is not None]
    assert len(fresh) >= steps // 4 and max(abs(k) for k in fresh) < 1e-3, (len(fresh), sorted(fresh, key=abs)[-5:])
