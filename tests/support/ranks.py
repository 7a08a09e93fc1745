"""Run a test-support module as one process or as the ranks of one machine under torchrun (gloo), the way
the multi-rank tests all do:

    run_module(["tests.support.learner_grads", OUT, "one=100000"])            # python -m ...
    run_module(["tests.support.learner_grads", OUT, "ranks=48/0"], ranks=2)    # torchrun --standalone ...

A failed run fails the test with the tail of what it printed.
"""

from __future__ import annotations

import subprocess
import sys

from tests.support.services import ROOT, child_env

TIMEOUT_S = 600


def torchrun(ranks: int) -> list[str]:
    """The command line that starts ``ranks`` ranks of one job on this machine (one process when 1)."""
    if ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]


def run_module(args: list[str], ranks: int = 1, timeout: float = TIMEOUT_S) -> str:
    """``python -m args...`` on ``ranks`` ranks; asserts it exits 0 and returns what it printed."""
    cmd = [*torchrun(ranks), "-m", *map(str, args)]
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res.stdout + res.stderr
