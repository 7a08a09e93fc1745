"""``relay up --resume RUN``: continue an interrupted run (Ctrl-C, SIGTERM, a crash) to its steps.

The same run folder and run id, the services' recorded configs (``config/*.json``) and the way
``relay up`` launched them (``launch.json``: generators, learner ranks, Redis); Redis comes back
from the run folder's append-only file (``--redis-aof``, everysec by default), so the replay queue,
the broker's feeder position and the learner's commit log are where the run left them, and the
learner continues from its newest checkpoint (docs/learner.md). Only the ports may change: a
recorded port that is now taken is replaced by a free one in every config that names it. The run's
secrets (``secrets/``: the Redis users' passwords, the announcement key pair, the weights key) are
reused; an external Redis's URL, recorded with its password redacted, comes again from
``RELAY_REDIS_URL``. A run made before announcements were signed with Ed25519 (its announcement key is
the HMAC key every service held) is refused, saying how to continue from its weights in a new run
(docs/security.md, "Runs from before Ed25519").
"""

from __future__ import annotations

import json
from pathlib import Path

LAUNCH = "launch.json"  # how relay up started the run (what resume needs beyond config/*.json)
# flags that would change a run: a resumed run keeps its recorded config
_FIXED = (
    "task",
    "model",
    "backend",
    "steps",
    "config",
    "seed",
    "run_id",
    "redis_url",
    "generators",
    "learner_ranks",
    "learner_nodes",
    "producers",
)


def launch_record(args, embedded_redis: bool) -> dict:
    return {
        "generators": args.generators,
        "learner_ranks": args.learner_ranks,
        "learner_nodes": args.learner_nodes,
        "embedded_redis": embedded_redis,
        "redis_aof": args.redis_aof,
        "producers": args.producers or 0,
    }


def run_folder(run: str, runs_dir: str | Path) -> Path:
    """A run folder from a path, or a run id (or ``latest``) under ``runs_dir``."""
    for p in (Path(run), Path(runs_dir) / run):
        if (p / "config").is_dir():
            return p.resolve()
    raise FileNotFoundError(
        f"{run!r} is not a run folder (looked in {Path(run)} and {Path(runs_dir) / run}; a run folder holds config/)"
    )


def _resumable(args, environ, usage_error) -> Path:
    """The folder of the run ``--resume`` names, once it is one that can be resumed as asked: no flag or
    ``RELAY_*`` variable that would change its recorded config, not running, started by a ``relay up`` that
    recorded its launch, and made since announcements were signed with Ed25519."""
    from deploy.launcher import environment
    from deploy.launcher.run_secrets import made_before_ed25519

    given = [f"--{name.replace('_', '-')}" for name in _FIXED if getattr(args, name) is not None] + (
        ["--set"] if args.set else []
    )
    if given:
        raise usage_error(
            f"--resume continues a run with its recorded config (config/*.json); leave out {', '.join(given)}"
        )
    environment.resolve(environment.config_models(), environ)  # refuses unknown RELAY_* variables
    secret_vars = set(environment.SECRETS.values())
    setting = sorted(
        k
        for k in environ
        if k.startswith(environment.PREFIX) and k not in environment.NOT_CONFIG and k not in secret_vars
    )
    if setting:
        raise usage_error(
            f"--resume continues a run with its recorded config (config/*.json); unset {', '.join(setting)}"
        )
    try:
        run_dir = run_folder(args.resume, args.runs_dir)
    except FileNotFoundError as e:
        raise usage_error(str(e)) from None
    running = still_running(run_dir)
    if running:
        raise usage_error(f"run {run_dir.name} is still running ({', '.join(running)}): stop it first (Ctrl-C)")
    if not (run_dir / LAUNCH).is_file():
        raise usage_error(f"{run_dir} has no {LAUNCH}: it was not started by a `relay up` that can resume it")
    if made_before_ed25519(run_dir):
        raise usage_error(
            f"run {run_dir.name} was made before weight announcements were signed with Ed25519: its "
            f"announcement key is the HMAC key every generator held, so its announcements cannot be "
            f"trusted by this version and it cannot be resumed. Continue from its weights in a new run: "
            f"relay export {run_dir} --out {run_dir.name}-model, then relay up --model "
            f"{run_dir.name}-model (docs/security.md, 'Runs from before Ed25519')"
        )
    return run_dir


def _resumed_redis(run_dir: Path, cfgs: dict, launch: dict, environ, usage_error):
    """(the embedded Redis's port, its users, the launcher's Redis URL) of a resumed run, each service's
    ``redis_url`` in ``cfgs`` set to match: the run's own embedded Redis on its recorded port (another if that
    is taken now), its append-only file read back; or the external Redis it used, its URL with the password
    given again as ``RELAY_REDIS_URL`` (never written to the run folder)."""
    from deploy.launcher.procs import find_redis_server, free_port, port_in_use
    from deploy.launcher.run_secrets import LAUNCHER_USER, RedisUsers

    redis_port = None
    users = None
    launcher_url = cfgs["learner"]["redis_url"]
    if launch["embedded_redis"]:
        if launch["redis_aof"] == "off" or not (run_dir / "appendonlydir").is_dir():
            raise usage_error(
                f"run {run_dir.name} kept no Redis data (--redis-aof off): its queue and commit log "
                f"are gone, it cannot be resumed"
            )
        find_redis_server()
        redis_port = _port_of(cfgs["learner"]["redis_url"])
        if port_in_use(redis_port):
            redis_port = free_port()
        users = RedisUsers.read(run_dir, cfgs["learner"]["run_id"])  # None: a run from before Redis had users
        for name, c in cfgs.items():
            if "redis_url" in c:  # the reward service has none
                c["redis_url"] = users.url(name, redis_port) if users else f"redis://127.0.0.1:{redis_port}/0"
        launcher_url = users.url(LAUNCHER_USER, redis_port) if users else cfgs["learner"]["redis_url"]
    elif "***" in launcher_url:  # an external Redis with a password: the file has it redacted
        if "RELAY_REDIS_URL" not in environ:
            raise usage_error(
                f"run {run_dir.name} used the Redis at {launcher_url}: give its URL with the password "
                f"again as RELAY_REDIS_URL (it is never written to the run folder)"
            )
        launcher_url = environ["RELAY_REDIS_URL"]
        for c in cfgs.values():
            if "redis_url" in c:
                c["redis_url"] = launcher_url
    return redis_port, users, launcher_url


def plan_resume(args, environ, usage_error) -> dict:
    """The plan (as :func:`deploy.launcher.plan.plan` returns it) of the run to resume."""
    from deploy.launcher import environment
    from deploy.launcher.openai_key import endpoint_key
    from deploy.launcher.plan import hold_ports
    from deploy.launcher.producers import producer_ids

    run_dir = _resumable(args, environ, usage_error)
    env_over = environment.resolve(environment.config_models(), environ)
    launch, cfgs, learner, summary = _recorded(run_dir, usage_error)
    redis_port, users, launcher_url = _resumed_redis(run_dir, cfgs, launch, environ, usage_error)
    http_port = _keys_and_ports(run_dir, cfgs, args.dashboard_port)
    _secrets_again(run_dir, cfgs, env_over)
    openai_key = endpoint_key(cfgs["generator"], run_dir)  # the run's own (secrets/openai.key), when it made one
    _generator_section(run_dir, cfgs["generator"])
    args.generators, args.learner_ranks = launch["generators"], launch["learner_ranks"]
    args.learner_nodes = launch.get("learner_nodes", 1)  # a run recorded before learner nodes had one
    args.redis_aof = launch["redis_aof"]
    p = {
        "run_id": cfgs["learner"]["run_id"],
        "run_dir": run_dir,
        "runs_dir": run_dir.parent,
        "http_port": http_port,
        "redis_url": launcher_url,
        "redis_port": redis_port,
        "redis_users": users,
        "resumed": summary,
        "openai_key": openai_key,
        **cfgs,
        "learner_config": learner,
        "generator_ids": [f"gen-{i}" for i in range(args.generators)],
        "producer_ids": producer_ids(launch.get("producers", 0)),
    }  # their keys and Redis users are kept
    return hold_ports(p, {"ingest", "reward"} | ({"http"} if not args.dashboard_port else set()))


def _recorded(run_dir: Path, usage_error) -> tuple[dict, dict, object, dict]:
    """What the run recorded: its launch settings, each service's config (generator-0's for the generators),
    the learner's config validated (defaults filled in) and its summary so far; ``usage_error`` when there
    is nothing to resume (completed, or no checkpoints)."""
    from pydantic import ValidationError

    from broker.runtime.config import format_validation_error, migrate
    from deploy.launcher import environment
    from deploy.launcher.plan import fill_generation_budget
    from generators.config import GeneratorConfig
    from learner.config import LearnerConfig

    launch = json.loads((run_dir / LAUNCH).read_text())
    cfg_dir = run_dir / "config"
    cfgs = {name: json.loads((cfg_dir / f"{name}.json").read_text()) for name in ("broker", "reward", "learner")}
    cfgs["generator"] = json.loads((cfg_dir / "generator-0.json").read_text())
    # an older run's keys (a recorded config is whole: an old weights.http section is settled by its transport)
    cfgs = {name: migrate(environment.config_models()[name], c, final=True) for name, c in cfgs.items()}
    try:
        generator = GeneratorConfig.model_validate(cfgs["generator"])
    except ValidationError as e:
        raise usage_error(f"{cfg_dir / 'generator-0.json'}: {format_validation_error(e)}") from None
    # a run recorded before the learner was told the generation budget (its T of seq-mean-token-sum-norm) gets
    # it as relay up gives it now; not the longest prompt: the run started without that check, it is not refused
    # now that it can no longer be changed (learner.batch.max_prompt_tokens stays 0, not known)
    fill_generation_budget(cfgs["learner"], generator)
    try:
        learner = LearnerConfig.model_validate(cfgs["learner"])  # the recorded values, defaults filled in
    except ValidationError as e:
        raise usage_error(f"{cfg_dir / 'learner.json'}: {format_validation_error(e)}") from None
    steps = learner.steps
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    if summary.get("status") == "completed":
        raise usage_error(f"run {run_dir.name} completed ({summary.get('steps')} of {steps} steps): nothing to resume")
    if learner.publish.checkpoint_every == 0:
        raise usage_error(
            f"run {run_dir.name} has learner.publish.checkpoint_every = 0: no checkpoint to continue from"
        )
    return launch, cfgs, learner, summary


def _keys_and_ports(run_dir: Path, cfgs: dict, dashboard_port: int | None) -> int:
    """The run's keys given to the configs of a run from before announcements were signed; the weight
    server's recorded port moved (in the learner's and the generators' configs) when it is taken now; the
    dashboard's port (``--dashboard-port``, else the recorded one), returned."""
    from broker.runtime.config import deep_merge
    from deploy.launcher.procs import free_port, port_in_use
    from deploy.launcher.run_secrets import run_key_fields

    keyed = run_key_fields(run_dir)  # a run from before announcements were signed gets the keys now
    for name in ("broker", "learner", "generator"):
        if cfgs[name].get("announce_auth", "ed25519") == "ed25519":
            cfgs[name] = deep_merge(keyed[name], cfgs[name])
    http = cfgs["learner"].get("weights", {}).get("transport", {})
    old = http.get("port")
    if http.get("type") == "http" and old and port_in_use(old):
        new = free_port()  # the generators fetch from the recorded port: both move
        for name in ("learner", "generator"):
            transport = cfgs[name].get("weights", {}).get("transport", {})
            if transport.get("type") == "http" and transport.get("port") == old:
                transport["port"] = new
    # the recorded ports, held again by hold_ports (a port taken now moves, each config that names it following)
    http_port = cfgs["broker"].get("http_port", 8080)
    if dashboard_port is not None:
        http_port = dashboard_port or free_port()
    cfgs["broker"]["http_port"] = http_port
    return http_port


def _secrets_again(run_dir: Path, cfgs: dict, env_over: dict) -> None:
    """Tokens are never recorded: they come from the environment (``env_over``) again, as when the run
    started; the reward service's, when none is given again, is the run's own."""
    from deploy.launcher import environment
    from deploy.launcher.run_tokens import recorded_reward_token

    for name, c in cfgs.items():
        for path in environment.SECRETS:
            value = env_over[name]
            for p in path:
                value = value.get(p) if isinstance(value, dict) else None
            if value is not None:
                d = c
                for p in path[:-1]:
                    d = d.setdefault(p, {})
                d[path[-1]] = value
    if not cfgs["reward"].get("auth_token"):  # none given again: the run's own (deploy/launcher/run_tokens.py)
        cfgs["reward"]["auth_token"] = recorded_reward_token(run_dir)
    if cfgs["reward"].get("auth_token") and not cfgs["generator"].get("reward_token"):
        cfgs["generator"]["reward_token"] = cfgs["reward"]["auth_token"]


def _generator_section(run_dir: Path, generator: dict) -> None:
    """generator-0's config made the run's generator section, but for what relay up gave generator 0 alone:
    its id and its ingest key (one of the run's, in secrets/ingest/); each generator gets its own again."""
    from deploy.launcher.ingest_keys import ingest_key_dir

    generator.pop("id", None)
    own_key = generator.get("ingest_key_file")
    if own_key and Path(own_key).parent == ingest_key_dir(run_dir):
        del generator["ingest_key_file"]


def still_running(run_dir: Path) -> list[str]:
    """The run's processes (``pids.json``) that are alive and still this run's (their command line
    names the run folder: a PID reused by another program does not count)."""
    path = run_dir / "pids.json"
    if not path.is_file():
        return []
    alive = []
    for name, pid in json.loads(path.read_text()).items():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone
        if str(run_dir) in cmd:
            alive.append(f"{name} pid {pid}")
    return alive


def _port_of(address: str) -> int:
    return int(address.rstrip("/").rsplit(":", 1)[1].split("/")[0])


def resume_command(run_dir: Path) -> str:
    """The command that resumes this run, as the user can type it here."""
    return f"{relay_command()} up --resume {_typed(run_dir)}"


def relay_command(argv0: str | None = None, executable: str | None = None) -> str:
    """The ``relay`` command as the user can type it again from here, from how this process was started:
    ``relay`` when that is the one on PATH, else the path it was run by (``.venv/bin/relay`` when typed
    so, relative to here when below it), or ``<python> -m deploy.cli`` when it was run as a module."""
    import shutil
    import sys

    argv0 = sys.argv[0] if argv0 is None else argv0
    script = Path(argv0)
    if not script.is_file():  # python -c, an embedding: the command's name
        return "relay"
    if script.name == "cli.py" and script.parent.name == "deploy":  # python -m deploy.cli
        return f"{_typed(Path(executable or sys.executable))} -m deploy.cli"
    on_path = shutil.which(script.name)
    if script.name == "relay" and on_path and Path(on_path).resolve() == script.resolve():
        return "relay"
    return _typed(script)


def _typed(path: Path) -> str:
    """``path`` as it can be typed here: relative below the working folder (``./x`` for a bare name, which
    a shell would look up on PATH), absolute elsewhere."""
    try:
        shown = path.absolute().relative_to(Path.cwd())
    except ValueError:
        return str(path.absolute())
    return str(shown) if len(shown.parts) > 1 else f"./{shown}"
