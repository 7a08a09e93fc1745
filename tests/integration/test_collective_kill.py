"""`relay up --set weights.transport=collective` while a generator is SIGKILLed mid-run: the supervisor
restarts it, it catches up from the store, joins the broadcast again and applies later versions through
the collective; no version applied anywhere has a digest other than the one announced for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from broker.protocol.keys import Keys
from broker.protocol.messages import decode_announcement
from deploy.launcher.run_secrets import run_redis_url
from tests.support.services import ROOT, child_env

STEPS = 120
KILL_AT_STEP = 40


class Watcher(threading.Thread):
    """Records every event and every announcement while the run lasts (its Redis stops with it) and
    SIGKILLs gen-0 (by its PID in pids.json, checked to be that service) once the learner reached
    KILL_AT_STEP."""

    def __init__(self, run: Path):
        super().__init__(daemon=True)
        self.run_dir = run
        self.stop = threading.Event()
        self.events: list[tuple[str, dict]] = []
        self.announced: dict[int, str] = {}  # version -> digest
        self.killed: dict | None = None
        self.error: str | None = None
        self._last = "0-0"

    def _kill(self, step: int) -> None:
        pid = json.loads((self.run_dir / "pids.json").read_text()).get("gen-0")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() if pid else ""
        if "deploy.cli" not in cmd or str(self.run_dir / "config/generator-0.json") not in cmd:
            raise AssertionError(f"pid {pid} of gen-0 is not that service: {cmd!r}")
        os.kill(pid, signal.SIGKILL)
        self.killed = {"pid": pid, "step": step, "event": self._last}

    def run(self) -> None:
        try:
            while not (self.run_dir / "config" / "broker.json").is_file() and not self.stop.is_set():
                time.sleep(0.2)
            r, keys = redis.Redis.from_url(run_redis_url(self.run_dir), socket_timeout=5), Keys("collkill")
            while not self.stop.is_set():
                try:
                    for eid, f in r.xrange(keys.events, min=f"({self._last}"):
                        self._last = eid.decode()
                        self.events.append((f[b"kind"].decode(), json.loads(f[b"data"])))
                    for v, raw in r.hgetall(keys.versions).items():
                        self.announced[int(v)] = decode_announcement(raw).digest
                    step = int(r.hget(keys.stats("learner"), "step") or 0)
                except redis.ConnectionError:
                    return  # relay up stopped its Redis: the run is over
                if self.killed is None and step >= KILL_AT_STEP:
                    self._kill(step)
                time.sleep(0.2)
        except Exception as e:  # reported by the test
            self.error = f"{type(e).__name__}: {e}"


@pytest.mark.slow
def test_a_generator_killed_under_collective_restarts_catches_up_and_rejoins(tmp_path):
    run = tmp_path / "collkill"
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--runs-dir", str(tmp_path), "--run-id", "collkill",
           "--steps", str(STEPS), "--generators", "2", "--dashboard-port", "0", "--no-progress", "--max-restarts", "3",
           "--set", "weights.transport=collective", "--set", "weights.collective.timeout_s=10",
           "--set", "generator.claim_idle_s=10"]
    w = Watcher(run)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    w.start()
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        w.stop.set()
        if proc.poll() is None:
            proc.kill()
    w.join(10)
    report = f"killed {w.killed}\n--- relay up output (tail) ---\n{out[-3000:]}"
    assert w.error is None, f"{w.error}\n{report}"
    assert proc.returncode == 0, report
    assert w.killed is not None, report
    s = json.loads((run / "summary.json").read_text())
    assert s["restarts"]["gen-0"] >= 1, (s["restarts"], report)

    applied = [d for k, d in w.events if k == "applied"]
    by_gen = {g: [d for d in applied if d["generator"] == g] for g in ("gen-0", "gen-1")}
    via = {g: sum(d["via"] == "collective" for d in ds) for g, ds in by_gen.items()}
    print("versions applied via the collective:", via, "via the store:",
          {g: sum(d["via"] == "store" for d in ds) for g, ds in by_gen.items()}, "killed:", w.killed)
    # both applied versions through the collective; the killed one again after its restart
    assert via["gen-0"] >= 3 and via["gen-1"] >= 10, via
    joins = [d for k, d in w.events if k == "collective_joined" and d["generator"] == "gen-0"]
    assert len(joins) >= 2, joins  # its first session, and the one after the restart
    after = [d for (k, d) in w.events[[i for i, (k, d) in enumerate(w.events) if k == "collective_joined"
                                       and d["generator"] == "gen-0"][1]:] if k == "applied" and d["generator"] == "gen-0"]
    assert after and after[0]["via"] in ("store", "collective")
    assert any(d["via"] == "collective" for d in after), after  # it rejoined: later versions came by broadcast
    # provenance: every applied version has the digest that was announced for it
    assert all(d["version"] in w.announced for d in applied), sorted({d["version"] for d in applied} - set(w.announced))
    wrong = [d for d in applied if d["digest"] != w.announced[d["version"]]]
    assert not wrong, wrong
    assert all(w.announced[v] for v in w.announced), "an announcement without a tensor digest"
    assert not [d for k, d in w.events if k == "refused"], [d for k, d in w.events if k == "refused"]
