"""``relay up`` while the run trains (deploy/launcher/up.py ``run_up``: plan -> start -> watch -> report): the
services supervised (restarted when they die or hang, deploy/launcher/supervisor.py), the progress line,
failures after start-up said on the console (deploy/launcher/alerts.py), ``runs/latest`` moved once the
learner has published, and the end: the learner done, a service given up on, a failure that keeps
happening, or a signal; then the final evaluation round waited for and every service stopped in order.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from deploy.launcher.start import Started, stop_order


class Watch:
    """``rc`` (0, 1: failed, 130: stopped by a signal), ``error`` (why it failed, summary.json's), ``failure``
    (the service given up on, printed last), ``cut_short`` (a signal during the final evaluation round: what
    ``ended`` adds), ``started`` (``runs/latest`` points here)."""

    def __init__(self, args, p: dict, procs, started: Started):
        from broker.client.connection import connect_redis
        from broker.prompts.evals import EvalHistory
        from broker.protocol.keys import Keys
        from broker.protocol.signing import announce_verifier
        from deploy.launcher.alerts import ConsoleAlerts, LearnerEntries
        from deploy.launcher.progress import Progress, TruncationWarning
        from deploy.launcher.supervisor import RestartPolicy, Supervisor

        self.p, self.procs, self.args = p, procs, args
        cfgs = started.cfgs
        self.cfgs = cfgs
        policy = RestartPolicy(max_restarts=0 if args.no_restart else args.max_restarts, hang_s=args.hang_after)
        no_resume = {}
        if not p["learner_config"].publish.checkpoint_every:
            for c in procs.children:  # the learner, and each of its nodes (--learner-nodes)
                if c.name == "learner" or c.name.startswith("learner-"):
                    no_resume[c.name] = (
                        "learner.publish.checkpoint_every = 0, so a new learner would start over from the initial "
                        "weights"
                    )
        self.r = r = connect_redis(started.redis_url)
        self.keys = keys = Keys(p["run_id"])
        self.key = announce_verifier(
            cfgs["broker"].get("announce_auth", "ed25519"), cfgs["broker"].get("announce_public_key_file", "")
        )
        self.total = p["learner_config"].steps
        self.progress = Progress(not args.no_progress, self.total)
        reward_url = cfgs["generator"]["reward"]["url"]
        self.supervisor = Supervisor(
            procs,
            policy,
            p["run_dir"] / "pids.json",  # rewritten on restarts
            [c.name for c in procs.children if c.name != "redis"],
            no_resume,
            healthy=_health_probe(r, keys, reward_url, self.key),
            before_print=self.progress.done,
            alive_at=_liveness_probe(r, keys, reward_url, p["http_port"]),
        )
        print(
            f"relay up: dashboard at http://127.0.0.1:{p['http_port']}/ (state: /api/state, "
            f"or `relay status --url http://127.0.0.1:{p['http_port']}`); logs in {p['run_dir'] / 'logs'}",
            flush=True,
        )
        print(
            f"relay up: reward service at {reward_url} (/healthz, /metrics, /score"
            f"{' with the token in secrets/reward.token' if cfgs['reward'].get('auth_token') else ''})",
            flush=True,
        )
        self.evals = EvalHistory(r, keys)  # read incrementally: the latest round's pass@1 on the progress line
        self.truncation = TruncationWarning(self.progress, cfgs["generator"].get("sampling", {}).get("max_tokens"))
        self.alerts = ConsoleAlerts(
            self.progress.done, args.fail_after, p["run_dir"] / "logs", LearnerEntries(r, keys).new
        )
        self.rc, self.error, self.failure, self.cut_short, self.started = 0, None, None, "", False

    def run(self, stopping: dict) -> None:
        """Until the run ends (``stopping["why"]``: the signal received, set by the launcher's handler)."""
        self._supervise(stopping)
        if stopping["why"]:
            self.progress.done()
            print(
                f"relay up: {stopping['why']} received; stopping every service (the learner writes a checkpoint)",
                flush=True,
            )
            self.rc = 130
        elif self.rc == 0:
            self._final_round(stopping)
        # every service but Redis stops first, in dependency order, so that the audit below is exact: the
        # generators first (each scores, sends and releases the batch it holds), then the broker and the
        # reward service they needed, then the learner (its last step, checkpoint and commits land in Redis)
        for stage in stop_order([c.name for c in self.procs.children]):
            self.procs.stop(stage, timeout=60)

    def _supervise(self, stopping: dict) -> None:
        from broker.dashboard.state import build_state
        from deploy.launcher.alerts import RunFailure
        from deploy.launcher.progress import latest_eval
        from deploy.launcher.supervisor import GiveUp

        r, keys, progress = self.r, self.keys, self.progress
        while stopping["why"] is None:
            if not self.started and r.hexists(keys.stats("learner"), "version"):
                self.started = point_latest(self.p["runs_dir"], self.p["run_dir"])
            learner = self.supervisor.child("learner")
            if not learner.alive() and (learner.proc.returncode == 0 or r.exists(keys.done)):
                progress.done()  # the run is over: the learner finished its steps, or the data ran out
                if learner.proc.returncode != 0:
                    print(
                        f"relay up: the learner exited with code {learner.proc.returncode} after finishing the run",
                        file=sys.stderr,
                    )
                return
            try:
                self.supervisor.poll(lambda: bool(r.exists(keys.done)))
            except GiveUp as e:
                progress.done()
                self.failure = e  # printed last, after the summary, so it stays on the screen
                self.error, self.rc = str(e), 1
                return
            try:
                st = build_state(r, keys, announce_key=self.key)
                self.alerts.check(st)  # failures after start-up said on the console (deploy/launcher/alerts.py)
                self.truncation.check(st.get("learner", {}), self.alerts.policy.suspect())
                progress.show(st, self.supervisor.total(), latest_eval(self.evals.rounds()), self.alerts.flags())
            except RunFailure as e:  # one that keeps happening stops the run, its reason printed last
                progress.done()
                self.error, self.rc = str(e), 1
                return
            except Exception as e:  # the display must never stop the run; show why it is blank
                print(f"\rrelay up: progress unavailable: {e}", end="", file=sys.stderr)
            time.sleep(self.supervisor.sleep_hint(1.0))

    def _final_round(self, stopping: dict) -> None:
        """Let the generators see "done", answer the final evaluation round (they load the last version and
        exit once it is answered) and send their final heartbeats."""
        gens = [c for c in self.procs.children if c.name.startswith("gen-")]
        wait_s = final_eval_wait_s(self.cfgs["broker"])
        if wait_s > 15 and any(c.alive() for c in gens):
            print(
                f"relay up: the learner is done; waiting for the generators to answer the final evaluation "
                f"round (at most {wait_s:.0f} s)",
                flush=True,
            )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(c.alive() for c in gens) and stopping["why"] is None:
            time.sleep(0.2)
        self.cut_short = final_eval_cut_short(stopping["why"])  # the run is complete; the round left unanswered


def point_latest(runs_dir: Path, run_dir: Path) -> bool:
    """Point ``runs/latest`` at this run: once it has started (its learner published a version), so a
    start that failed never takes the name from the last run that worked."""
    latest = runs_dir / "latest"
    tmp = runs_dir / f".latest-{run_dir.name}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.name)
    tmp.replace(latest)  # atomic: readers see the old or the new run, never no link
    return True


def final_eval_wait_s(broker: dict) -> float:
    """How long relay up waits for the generators to exit after the learner is done: 15 s, or, with a
    final evaluation round, as long as ``broker.eval.final_timeout_s`` allows (a round on CPU takes a
    generator's current batch, a weight load and the round itself)."""
    from broker.prompts.evals import EvalConfig

    ev = EvalConfig.model_validate(broker.get("eval", {}))
    return max(15.0, ev.final_timeout_s) if ev.every_versions > 0 and ev.final else 15.0


def final_eval_cut_short(signal_name: str | None) -> str:
    """A signal while relay up waits for the final evaluation round: the learner has finished its steps and
    the final version is published, so the run is complete (status ``completed``, exit 0, the version
    exported, nothing to resume); the round is left unanswered. Says so now, and returns what
    ``summary.json``'s ``ended`` adds ("" without a signal)."""
    if signal_name is None:
        return ""
    print(
        f"relay up: {signal_name} received while the generators answered the final evaluation round; the learner "
        f"has finished its steps: stopping every service without that round",
        flush=True,
    )
    return f" (the final evaluation round cut short by {signal_name})"


def _health_probe(r, keys, reward_url: str, key: bytes | None = None):
    """``Supervisor``'s ``healthy(name)``: has that service come up? The broker: it advertised its
    ingest address; the learner: it published a version; a generator: its heartbeat serves a
    version; the reward service: ``/healthz`` answers."""
    import httpx
    import redis

    from broker.client.announcements import latest_announcement
    from broker.protocol.codec import ProtocolError
    from broker.protocol.messages import decode_heartbeat

    def healthy(name: str) -> bool:
        try:
            if name == "broker":
                return bool(r.hexists(keys.run, "ingest_address"))
            if name == "learner" or name.startswith("learner-"):  # a learner node: the job published
                return latest_announcement(r, keys, key) is not None
            if name == "reward":
                return httpx.get(f"{reward_url}/healthz", timeout=0.5).status_code == 200
            raw = r.hget(keys.generators, name)
            return raw is not None and decode_heartbeat(raw).version is not None
        except (redis.RedisError, httpx.HTTPError, ProtocolError):
            return False

    return healthy


def _liveness_probe(r, keys, reward_url: str, broker_http_port: int):
    """``Supervisor``'s ``alive_at(name)``: the unix time of a service's latest sign of life, None when
    there is none now. A generator: its heartbeat's ``last_seen`` (its main loop writes it, so a stuck
    loop goes silent too); the broker, the reward service and the learner: ``/healthz`` answering at all
    (a frozen process answers nothing)."""
    import httpx
    import redis

    from broker.protocol.codec import ProtocolError
    from broker.protocol.messages import decode_heartbeat

    def answers(url: str) -> float | None:
        try:
            httpx.get(f"{url}/healthz", timeout=1.0)
            return time.time()
        except httpx.HTTPError:
            return None

    def alive_at(name: str) -> float | None:
        try:
            if name == "broker":
                return answers(f"http://127.0.0.1:{broker_http_port}")
            if name == "reward":
                return answers(reward_url)
            if name == "learner" or name.startswith("learner-"):  # a learner node: the job answers
                port = r.hget(keys.stats("learner"), "metrics_port")
                return answers(f"http://127.0.0.1:{int(port)}") if port else None
            raw = r.hget(keys.generators, name)
            return decode_heartbeat(raw).last_seen if raw is not None else None
        except (redis.RedisError, ProtocolError, ValueError):
            return None

    return alive_at
