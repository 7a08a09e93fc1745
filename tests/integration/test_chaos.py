"""Chaos: `relay up` at tiny size while a killer sends SIGKILL to a generator, the broker, the reward
service and the learner at random moments (each at least twice), and freezes a generator and the
learner once each (SIGSTOP: alive but silent). relay up's supervisor restarts the dead ones and
kills then restarts the frozen ones (``--hang-after``); the run must still finish with every group accounted for (none lost, none trained twice),
versions strictly increasing across the learner's restarts, and the reward target reached.

The schedule is drawn from a seeded random (``RELAY_CHAOS_SEED``, default 1) as learner steps at
which to kill, plus a jitter of up to 2 s; it is printed with the result. Processes are found by
PID in ``runs/<id>/pids.json`` (which the supervisor rewrites after every restart) and checked to be
that run's service before being killed. The embedded redis-server is left alone.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from broker.protocol.keys import Keys
from deploy.launcher.run_secrets import run_redis_url
from tests.support.services import ROOT, child_env

STEPS = 400  # a run without kills reaches a mean reward above 0.95 within 250-500 steps (about 60-90 s idle)
REWARD_TARGET = 0.5  # mean reward of the last 10% of trained groups; it starts at about 0.05. Not 0.8: runs of
# this tiny model sometimes settle on partial copies (entropy collapsed, reward ~0.6) with or without kills
# (docs/reliability.md); the kills must not stop learning, which 0.05 -> 0.5 shows
TARGETS = ("generator", "broker", "reward", "learner")
KILLS_EACH = 2
FREEZES = ("generator", "learner")  # each frozen once with SIGSTOP: taken for hung after HANG_AFTER s
HANG_AFTER = 8
GENERATORS = 2


def _schedule(rng: random.Random) -> list[tuple[int, str, str, float, str]]:
    """(learner step, service, process name, jitter s, signal): each service KILLS_EACH times with
    SIGKILL and each of FREEZES once with SIGSTOP (a generator drawn among the replicas each time), in
    random order, at random steps between 8% and 75% of the run (the learner's kills undo up to
    checkpoint_every steps)."""
    actions = [(s, "SIGKILL") for s in TARGETS for _ in range(KILLS_EACH)] + [(s, "SIGSTOP") for s in FREEZES]
    rng.shuffle(actions)
    steps = sorted(rng.sample(range(int(STEPS * 0.08), int(STEPS * 0.75)), len(actions)))
    return [
        (st, svc, f"gen-{rng.randrange(GENERATORS)}" if svc == "generator" else svc, round(rng.uniform(0, 2.0), 2), sig)
        for st, (svc, sig) in zip(steps, actions)
    ]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


class Killer(threading.Thread):
    """Follows the learner's step in Redis and kills each scheduled service by its current PID; on the
    way it records every ``published`` event (the order versions were announced in)."""

    def __init__(self, run: Path, schedule: list[tuple[int, str, str, float, str]]):
        super().__init__(daemon=True)
        self.run_dir, self.schedule = run, schedule
        self.stop = threading.Event()
        self.done: list[dict] = []  # what was killed: service, name, pid, learner step, seconds since start
        self.published: list[int] = []
        self.error: str | None = None
        self._last_event = "0-0"
        self._first_step: dict[int, int] = {}  # learner pid -> the step reported when it was first seen

    def _pids(self) -> dict[str, int]:
        try:
            return json.loads((self.run_dir / "pids.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def _victim(self, name: str, step: int) -> int | None:
        """The service's current process if it is running (None while it is being restarted). A
        learner only once it has trained a step: a learner killed while DeepSpeed builds or loads its
        CPU op can leave torch's extension lock behind, which hangs every later learner (a known
        limitation, docs/reliability.md), not what this test is about."""
        pid = self._pids().get(name)
        if pid is None or not _alive(pid):
            return None
        if name == "learner" and self._first_step.setdefault(pid, step) >= step:
            return None
        cmd = _cmdline(pid)
        config = f"config/{'generator-' + name[4:] if name.startswith('gen-') else name}.json"
        if "deploy.cli" not in cmd or str(self.run_dir / config) not in cmd:
            raise AssertionError(f"pid {pid} of {name} in pids.json is not that service: {cmd!r}")
        return pid

    def _collect(self, r, keys: Keys) -> None:
        for eid, f in r.xrange(keys.events, min=f"({self._last_event}"):
            self._last_event = eid.decode()
            if f[b"kind"] == b"published":
                self.published.append(json.loads(f[b"data"])["version"])

    def run(self) -> None:
        t0 = time.monotonic()
        pending = list(self.schedule)
        kill_at = None  # monotonic time of the next kill, once its step is reached
        quiet_until = 0.0
        try:
            while not (self.run_dir / "config" / "broker.json").is_file() and not self.stop.is_set():
                time.sleep(0.2)
            url = run_redis_url(self.run_dir)
            r, keys = redis.Redis.from_url(url, socket_timeout=5), Keys("chaos")
            while not self.stop.is_set():
                try:
                    self._collect(r, keys)
                    step = int(r.hget(keys.stats("learner"), "step") or 0)
                except redis.ConnectionError:
                    return  # relay up stopped its Redis: the run is over
                now = time.monotonic()
                if pending and kill_at is None and step >= pending[0][0]:
                    kill_at = max(now + pending[0][3], quiet_until)
                if pending and kill_at is not None and now >= kill_at:
                    _, service, name, _, sig = pending[0]
                    pid = self._victim(name, step)
                    if pid is not None:  # else it is being restarted: kill the next incarnation
                        os.kill(pid, getattr(signal, sig))
                        self.done.append(
                            {
                                "service": service,
                                "name": name,
                                "pid": pid,
                                "step": step,
                                "t": round(now - t0, 1),
                                "signal": sig,
                            }
                        )
                        pending.pop(0)
                        # let the system notice before the next (a frozen one is taken for hung after HANG_AFTER)
                        kill_at, quiet_until = None, now + (3.0 if sig == "SIGKILL" else HANG_AFTER + 5.0)
                time.sleep(0.2)
        except Exception as e:  # reported by the test, with the schedule
            self.error = f"{type(e).__name__}: {e}"


@pytest.mark.slow
def test_chaos_every_service_killed_twice_loses_nothing(tmp_path):
    seed = int(os.environ.get("RELAY_CHAOS_SEED", "1"))
    rng = random.Random(seed)
    schedule = _schedule(rng)
    run = tmp_path / "chaos"
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "up",
        "--runs-dir",
        str(tmp_path),
        "--run-id",
        "chaos",
        "--steps",
        str(STEPS),
        "--generators",
        str(GENERATORS),
        "--dashboard-port",
        "0",
        "--no-progress",
        "--max-restarts",
        "5",
        "--hang-after",
        str(HANG_AFTER),
        "--set",
        "learner.publish.checkpoint_every=10",
        "--set",
        "generator.claim_idle_s=10",
    ]
    killer = Killer(run, schedule)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer.start()
    try:
        out, _ = proc.communicate(timeout=840)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # relay up stops every service by PID and still writes its summary
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        out = f"relay up did not finish in 840 s\n{out}"
    finally:
        killer.stop.set()
    killer.join(10)
    wall = time.monotonic() - t0
    supervision = "\n".join(ln for ln in out.splitlines() if ln.startswith("relay up:") and "summary" not in ln)
    report = (
        f"seed {seed}; schedule (step, service, process, jitter s): {schedule}\nkills: {killer.done}\n"
        f"wall {wall:.0f}s\n--- relay up's own lines ---\n{supervision}\n"
        f"--- relay up output (tail) ---\n{out[-4000:]}"
    )
    print(report)
    assert killer.error is None, f"the killer failed: {killer.error}\n{report}"
    assert proc.returncode == 0, report
    killed = {s: sum(k["service"] == s and k["signal"] == "SIGKILL" for k in killer.done) for s in TARGETS}
    assert all(n >= KILLS_EACH for n in killed.values()), f"not every kill happened: {killed}\n{report}"
    frozen = [k for k in killer.done if k["signal"] == "SIGSTOP"]
    assert sorted(k["service"] for k in frozen) == sorted(FREEZES), f"not every freeze happened\n{report}"

    s = json.loads((run / "summary.json").read_text())
    a = s["audit"]
    print(
        "summary:",
        json.dumps(
            {
                k: s[k]
                for k in (
                    "steps",
                    "versions_published",
                    "reward_first",
                    "reward_last",
                    "wall_seconds",
                    "audit",
                    "restarts",
                    "hangs",
                )
            }
        ),
    )
    assert a["lost"] == 0 and a["trained_twice"] == 0, (a, report)
    assert a["trained_once"] == STEPS * 32, (a, report)  # 32 groups a step, each counted once
    assert a["produced"] == a["trained_once"] + a["dropped"] + a["queued"], (a, report)
    # a restarted learner may drop as stale what it had trained since its checkpoint (at most
    # checkpoint_every × 32 groups a kill); beyond that, staleness must not run away (it did when a
    # group trained twice was counted twice by admission control: 1,681 and 2,685 drops)
    assert a["dropped"] <= KILLS_EACH * 10 * 32 + 0.05 * STEPS * 32, (a, report)
    assert s["steps"] == STEPS
    for k in killer.done:  # every kill was noticed and answered by a restart
        assert s["restarts"][k["name"]] >= sum(x["name"] == k["name"] for x in killer.done), (s["restarts"], report)
    for svc in ("broker", "reward", "learner"):
        assert s["restarts"][svc] >= KILLS_EACH, (s["restarts"], report)
    for k in frozen:  # each frozen service was taken for hung (killed by the supervisor) and restarted
        assert s["hangs"].get(k["name"], 0) >= 1, (s["hangs"], report)

    # versions: strictly increasing across every learner restart, as announced and as trained
    assert killer.published and all(b > a_ for a_, b in zip(killer.published, killer.published[1:])), (
        f"published versions not strictly increasing: {killer.published}"
    )
    assert killer.published[-1] == s["versions_published"]
    metrics = [json.loads(ln) for ln in (run / "learner" / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), report  # rolled-back steps not reported twice
    versions = [m["version"] for m in metrics]
    assert all(b > a_ for a_, b in zip(versions, versions[1:])), f"versions not strictly increasing: {versions}"
    log = (run / "logs" / "learner.log").read_text()
    assert log.count("resumed from checkpoint at step") >= KILLS_EACH, report
    # each learner restart publishes its checkpoint's weights as a new version, then redoes the lost steps
    assert s["versions_published"] >= STEPS + KILLS_EACH

    assert s["reward_last"] >= REWARD_TARGET, (s["reward_first"], s["reward_last"], report)
