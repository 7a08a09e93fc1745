"""CPU seconds from Linux's ``/proc/<pid>/stat`` (or a thread's ``/proc/<pid>/task/<tid>/stat``): the
generators' hang watch reads its own threads (generators/liveness.py), ``relay bench ingest`` the
broker's processes (benchmarks/ingest.py)."""

from __future__ import annotations

import os

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def stat_cpu_s(path: str) -> float | None:
    """User + system CPU seconds in the ``stat`` file at ``path``; None where ``/proc`` cannot say (not
    Linux, or the process or thread is gone)."""
    try:
        with open(path, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # fields after the command name (which may hold spaces, inside parentheses): utime, stime are 14, 15
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return (int(fields[11]) + int(fields[12])) * _TICK_S
    except (IndexError, ValueError):
        return None
