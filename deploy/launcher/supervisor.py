"""``relay up``'s supervisor: a service that dies while the run is not finished is started again.

Policy, per service (broker, reward, each generator, the learner; never the embedded Redis):

- a child that exits with a non-zero code or is killed by a signal while the run is not finished is
  restarted with the same command, after a back-off that doubles with each consecutive failure
  (``backoff_s``, 2×, 4×, … up to ``backoff_max_s``; it starts over once a child has stayed up
  ``stable_s``), at most ``max_restarts`` times per service over the run;
- a clean exit (code 0) is never restarted: the learner finished, or a generator saw the run done;
- once the run is finished (the learner's done key), nothing is restarted;
- a service that dies before it first became healthy (``healthy``: the broker serving, the learner's
  first version published, a generator serving a version, the reward service answering) is never
  restarted: it failed at start-up, and would fail the same way again; it fails the run at once,
  with its last log lines;
- a service past its budget, or one that may not be restarted (``restartable``), fails the run;
- a service that keeps failing for the same reason fails the run instead of being restarted again:
  one that exits with code 2 (a configuration error: ``relay <service>`` exits 2 on a bad config, a
  generator on a refused ingest key or reward token; a restart runs into it again), or one whose last
  ``same_error_deaths`` deaths (each with an exit code, within ``same_error_window_s``) ended on the
  same last log line (:func:`last_error`, the last line of its traceback);
- a service that has come up and then shows no sign of life for ``hang_s`` (``alive_at``: a
  generator's heartbeat, the others' ``/healthz`` answering; a process frozen by SIGSTOP, or stuck
  where it cannot heartbeat) is taken for dead: it is killed (SIGKILL), counted in ``hangs``, and
  restarted like any other death.

Every death is logged on stderr with the service's last error line, every restart is counted per
service (``restarts``, which ``summary.json`` reports, with each service's last error in
``restart_errors``), and the current PIDs are rewritten to ``pids.json`` (atomically) so an operator
or a test can find each service by PID.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from broker.client.connection import Backoff
from deploy.launcher.procs import Child, ProcessGroup


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 10  # per service, over the whole run; 0 = never restart
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    stable_s: float = 30.0  # a child up this long has its back-off start over
    hang_s: float = 0.0  # no sign of life for this long = hung (killed, then restarted); 0 = not watched
    probe_every_s: float = 2.0  # how often each service's sign of life is looked for
    same_error_deaths: int = 3  # this many deaths in a row on the same error line fail the run (0 = never)
    same_error_window_s: float = 600.0  # ... when they all happened within this many seconds

    def delay(self, consecutive: int) -> float:
        """Seconds to wait before restart number ``consecutive`` (1, 2, …) of a quick-failing child."""
        return Backoff(self.backoff_s, self.backoff_max_s).delay(consecutive)


class GiveUp(Exception):
    """A service died and will not be restarted; the message says which and why."""

    def __init__(self, child: Child, why: str, at_start: bool = False):
        super().__init__(f"{child.name} (pid {child.pid}) exited with code {child.proc.returncode}; {why}")
        self.child = child
        self.at_start = at_start  # it died before it first became healthy

    def last_error(self) -> str:
        """The service's last log line that says what went wrong (the last line of a traceback)."""
        return last_error(self.child) or "(its log is empty)"


# a service's exit code for a configuration error (`relay <service>` on a bad config, a generator whose
# ingest key or reward token is refused): a restart would fail the same way
CONFIG_ERROR_EXIT = 2


def last_error(child: Child) -> str:
    """The child's last non-empty log line, whitespace collapsed ("" when its log is empty): the last line
    of a traceback, or the error a service logged before it exited."""
    lines = [" ".join(ln.split()) for ln in child.tail(40).splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


class Supervisor:
    def __init__(
        self,
        procs: ProcessGroup,
        policy: RestartPolicy,
        pids_path: Path,
        services: list[str],
        not_restartable: dict[str, str] | None = None,
        healthy: Callable[[str], bool] | None = None,
        before_print: Callable[[], None] | None = None,
        alive_at: Callable[[str], float | None] | None = None,
    ):
        """``services``: the names of the children to watch (the rest, e.g. redis, are left alone).
        ``not_restartable``: name -> why a restart would be wrong (it fails the run instead).
        ``healthy(name)``: has that service come up (asked until it first says yes)? None: every
        service counts as up from its start (every death may be restarted). ``before_print``: called
        before a restart is announced (relay up ends its progress line there, so the message gets
        a line of its own). ``alive_at(name)``: the unix time of that service's latest sign of life
        (None: none seen now); with ``policy.hang_s``, a service silent for longer is killed as hung."""
        self.procs = procs
        self.policy = policy
        self.pids_path = pids_path
        self.services = list(services)
        self.not_restartable = dict(not_restartable or {})
        self.restarts: Counter[str] = Counter({name: 0 for name in services})
        self._consecutive: Counter[str] = Counter()
        self._due: dict[str, float] = {}  # name -> monotonic time of its pending restart
        self.healthy = healthy
        self.came_up: set[str] = set() if healthy else set(services)  # services seen healthy at least once
        self.before_print = before_print or (lambda: None)
        self.alive_at = alive_at
        self.hangs: Counter[str] = Counter()  # services killed because they stopped showing signs of life
        self._last_sign: dict[int, float] = {}  # pid -> unix time of that process's latest sign of life
        self._probed: dict[str, float] = {}  # name -> monotonic time of its last probe
        self.errors: dict[str, str] = {}  # name -> the last error line of its latest death (summary's restart_errors)
        self._deaths: dict[str, list[tuple[float, str]]] = {}  # name -> (monotonic time, error line) of its deaths
        self.write_pids()

    def child(self, name: str) -> Child:
        return next(c for c in self.procs.children if c.name == name)

    def write_pids(self) -> None:
        tmp = self.pids_path.with_name(f".{self.pids_path.name}.tmp")
        tmp.write_text(json.dumps({c.name: c.pid for c in self.procs.children}))
        os.replace(tmp, self.pids_path)

    def poll(self, finished: Callable[[], bool]) -> None:
        """Restart what died and is due; schedule what just died. Raises GiveUp when a service died
        for good while the run is not finished. ``finished()``: has the learner marked the run done?
        It is asked after a death is seen, so a generator that exits because the run is done is
        never taken for one that quit early."""
        now = time.monotonic()
        for name in self.services:
            c = self.child(name)
            if name not in self.came_up and self.healthy(name):  # asked once more after a death: it may
                self.came_up.add(name)  # have come up since the last poll
            if c.alive():
                if name in self.came_up and not finished():
                    self._watch(c, now)
                continue
            rc = c.proc.returncode
            if (rc == 0 and name == "learner") or finished():
                continue  # the run is over: exits are expected, nothing is restarted
            if name not in self.came_up:
                raise GiveUp(
                    c, "it failed at start-up, before it first became healthy, so it is not restarted", at_start=True
                )
            if rc == 0:
                raise GiveUp(c, "a clean exit before the run finished is not restarted")
            if name in self.not_restartable:
                raise GiveUp(c, f"not restarted: {self.not_restartable[name]}")
            if rc == CONFIG_ERROR_EXIT:
                raise GiveUp(c, "it stopped on a configuration error (exit code 2), which a restart would not fix")
            if name not in self._due:
                if self.restarts[name] >= self.policy.max_restarts:
                    raise GiveUp(
                        c, f"restart budget spent ({self.restarts[name]} of --max-restarts {self.policy.max_restarts})"
                    )
                error = last_error(c)
                self._same_error(c, now, error)
                uptime = now - c.started_at
                self._consecutive[name] = 1 if uptime >= self.policy.stable_s else self._consecutive[name] + 1
                delay = self.policy.delay(self._consecutive[name])
                self._due[name] = now + delay
                how = f"signal {-rc}" if rc < 0 else f"code {rc}"
                self.before_print()
                print(
                    f"relay up: {name} (pid {c.pid}) died ({how}) after {uptime:.1f}s"
                    f"{f': {error}' if error and rc > 0 else ''}; restart {self.restarts[name] + 1}/"
                    f"{self.policy.max_restarts} in {delay:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
            elif now >= self._due[name]:
                del self._due[name]
                new = self.procs.restart(c)
                self.restarts[name] += 1
                self.write_pids()
                self.before_print()
                print(f"relay up: {name} restarted (pid {new.pid})", file=sys.stderr, flush=True)

    def _same_error(self, c: Child, now: float, error: str) -> None:
        """Record a death of ``c`` (``error``: its last log line); GiveUp when its last ``same_error_deaths``
        deaths with an exit code (a kill by a signal says nothing about the service) ended on that same line
        within ``same_error_window_s``: it keeps failing for one reason, which a restart does not fix."""
        if c.proc.returncode <= 0 or not error:
            self._deaths.pop(c.name, None)  # a signal (or nothing logged) breaks the streak
            return
        self.errors[c.name] = error
        deaths = self._deaths.get(c.name, [])
        if deaths and deaths[-1][1] != error:
            deaths = []  # another reason: the streak starts over
        deaths = [d for d in deaths if now - d[0] <= self.policy.same_error_window_s] + [(now, error)]
        self._deaths[c.name] = deaths
        n = self.policy.same_error_deaths
        if n and len(deaths) >= n:
            raise GiveUp(
                c,
                f"it failed {len(deaths)} times in a row with the same error within "
                f"{now - deaths[0][0]:.0f}s, which restarting does not fix",
            )

    def _watch(self, c: Child, now: float) -> None:
        """Kill ``c`` when it has shown no sign of life for ``policy.hang_s`` (it is then restarted as dead)."""
        if (
            not self.policy.hang_s
            or self.alive_at is None
            or now - self._probed.get(c.name, 0.0) < self.policy.probe_every_s
        ):
            return
        self._probed[c.name] = now
        started = time.time() - (now - c.started_at)  # this process's start, in unix time
        sign = self.alive_at(c.name)
        if sign is not None and sign >= started:  # a sign of this process, not of the one it replaced
            self._last_sign[c.pid] = max(self._last_sign.get(c.pid, 0.0), sign)
        last = self._last_sign.get(c.pid)
        if last is None:  # not seen alive since it (re)started: its start-up (loading a model) is not watched
            return
        silent = time.time() - last
        if silent <= self.policy.hang_s:
            return
        self.hangs[c.name] += 1
        self.before_print()
        print(
            f"relay up: {c.name} (pid {c.pid}) hung: no sign of life for {silent:.0f}s (--hang-after "
            f"{self.policy.hang_s:g}); killing it",
            file=sys.stderr,
            flush=True,
        )
        self.procs.kill(c)

    def sleep_hint(self, idle_s: float) -> float:
        """How long the caller may sleep before the next ``poll``: ``idle_s``, or less when a restart is due."""
        if not self._due:
            return idle_s
        return max(0.05, min(idle_s, min(self._due.values()) - time.monotonic()))

    def total(self) -> int:
        return sum(self.restarts.values())
