"""``relay up``'s start: the run's secrets, the services' config files and their processes (deploy/launcher/up.py
``run_up``: plan -> start -> watch -> report), and the order they stop in."""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from deploy.launcher.plan import SERVICES


@dataclass
class Started:
    cfgs: dict  # service -> its config (the generators' section before each one's id and key)
    redis_url: str  # the launcher's Redis (on another port than planned if the embedded one's was taken)


def start_services(args, p: dict, procs) -> Started:
    """Write the run's keys and tokens (kept when resuming), start the embedded Redis when the run has one,
    then the broker, the reward service, the learner (one process per rank) and the generators, each with
    its config file (mode 0600; its secrets in its environment) and the ports ``plan`` holds for it."""
    from deploy.launcher import embedded_redis
    from deploy.launcher.ingest_keys import write_run_ingest_keys
    from deploy.launcher.openai_key import endpoint_note
    from deploy.launcher.producers import note as producers_note, write_connection_files
    from deploy.launcher.run_secrets import write_run_keys
    from deploy.launcher.run_tokens import keep_reward_token

    run_dir: Path = p["run_dir"]
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
    gen_keys = write_run_ingest_keys(
        run_dir, cfgs["broker"], cfgs["generator"], p["generator_ids"], p["producer_ids"]
    )  # and each producer's of --producers N
    if write_connection_files(
        run_dir,
        p["run_id"],
        p["producer_ids"],
        cfgs["broker"],
        cfgs["generator"],
        cfgs["generator"]["reward"]["url"],
        p.get("redis_users"),
        redis_url,
    ):
        print(f"relay up: {producers_note(run_dir, p['producer_ids'])}", flush=True)
    env = _child_env()
    held = p["listeners"]  # the broker's and the reward service's ports, bound by plan() and handed over
    envs = {
        name: _write_config(run_dir / "config" / f"{name}.json", cfgs[name], {**env, **held.env(name)})
        for name in ("broker", "reward", "learner")
    }
    relay = [sys.executable, "-m", "deploy.cli"]
    procs.start(
        "broker",
        relay + ["broker", "--config", str(run_dir / "config/broker.json")],
        envs["broker"],
        pass_fds=held.fds("broker"),
    )
    procs.start(
        "reward",
        relay + ["reward", "--config", str(run_dir / "config/reward.json")],
        envs["reward"],
        pass_fds=held.fds("reward"),
    )
    learner_cmd = ["learner", "--config", str(run_dir / "config/learner.json")]
    if getattr(args, "learner_nodes", 1) > 1:  # torchrun nodes on this machine (deploy/launcher/nodes.py)
        start_learner_nodes(procs, relay + learner_cmd, envs["learner"], held, args, p["run_id"])
    elif args.learner_ranks > 1:  # one process per rank, their store on 127.0.0.1 (deploy/launcher/ranks.py)
        procs.start(
            "learner",
            [sys.executable, "-m", "deploy.launcher.ranks", str(args.learner_ranks), *relay, *learner_cmd],
            envs["learner"],
        )
    else:
        procs.start("learner", relay + learner_cmd, envs["learner"])
    for i, gcfg in enumerate(generator_configs(cfgs["generator"], gen_keys, args.generators)):
        path = run_dir / "config" / f"generator-{i}.json"
        procs.start(f"gen-{i}", relay + ["generator", "--config", str(path)], _write_config(path, gcfg, env))
    return Started(cfgs, redis_url)


def start_learner_nodes(procs, learner_cmd: list[str], env: dict, held, args, run_id: str) -> None:
    """``--learner-nodes M``: the learner as M torchrun nodes on this machine (``relay learner --nnodes M``),
    the services ``learner`` (node 0, which hosts the rendezvous on a port bound here and handed over, so a
    restarted node 0 serves the same one) and ``learner-1`` ... ``learner-<M-1>``, each restarted on its own.
    Everything they listen on is on the loopback interface."""
    from broker.runtime.ports import LISTEN_FDS, hold_port

    sock = hold_port("127.0.0.1")
    held.add("learner-rendezvous", sock)  # closed with the others when the run ends
    fd, port = sock.fileno(), sock.getsockname()[1]
    nodes = args.learner_nodes
    for i in range(nodes):
        node = ["--nnodes", str(nodes), "--nproc-per-node", str(args.learner_ranks // nodes), "--node-rank", str(i)]
        # each node its own loopback address: torchrun numbers the nodes in their addresses' order, so rank 0
        # (the leader) runs in node 0, the service ``learner``
        node += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--node-addr", f"127.0.0.{i + 1}"]
        if i == 0:
            procs.start("learner", learner_cmd + node, {**env, LISTEN_FDS: str(fd)}, pass_fds=(fd,))
        else:
            procs.start(f"learner-{i}", learner_cmd + node, env)


def stop_order(names: list[str]) -> list[list[str]]:
    """The services of a run (Redis left out: it stops last, on its own) in the order they stop: the
    generators (``gen-*``: each scores, sends and releases the batch it holds), then what they needed
    (the broker, the reward service), then the learner (its last step, checkpoint and commits; all of its
    nodes at once, since its checkpoint is a collective)."""
    gens = [n for n in names if n.startswith("gen-")]
    learner = [n for n in names if n == "learner" or n.startswith("learner-")]  # its nodes stop together
    return [gens, [n for n in names if n not in gens and n not in learner and n != "redis"], learner]


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
