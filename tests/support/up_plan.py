"""``relay up``'s plan for a test: the per-service configs it would start, nothing started."""

import argparse

from deploy.launcher.plan import plan
from deploy.launcher.up import add_up_arguments


def plan_up(tmp_path, *argv, environ=None) -> dict:
    """``relay up ARGV``'s plan under ``tmp_path`` (an external Redis URL: no redis-server binary is needed)."""
    p = argparse.ArgumentParser()
    add_up_arguments(p)
    return plan(
        p.parse_args(
            ["--runs-dir", str(tmp_path), "--dashboard-port", "0", "--redis-url", "redis://127.0.0.1:1/0", *argv]
        ),
        environ=environ or {},
    )
