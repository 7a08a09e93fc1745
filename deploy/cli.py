"""``relay``: one command, a subcommand per service, plus the local launcher.

    relay up          the whole stack on this machine (embedded Redis + every service)
    relay broker      ZeroMQ ingest -> Redis, prompt feeder, HTTP state/metrics
    relay reward      the reward service (HTTP)
    relay generator   one generator replica
    relay learner     the DeepSpeed learner
    relay bench       every stage measured against its raw baseline (benchmarks/, docs/benchmarks.md)
    relay status      the run's state as a table (generators' versions, hashes, lag; queue; failures),
                      or a finished run's report (relay status RUN)
    relay export      a run's trained model as a Hugging Face folder
    relay config      the config reference (docs/config.md) and a run's effective config

Every service takes ``--config FILE`` (JSON or TOML), ``RELAY_<FIELD>`` environment variables,
and ``--set field.sub=value`` overrides, in that increasing precedence; docs/config.md lists
every field. Heavy packages (torch, transformers, DeepSpeed) are
imported only after the config is validated, so ``--help`` and config errors are instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from broker.runtime.config import ConfigError, load_config, set_overrides


# a valid ``--set`` of each service (tests/unit/deploy/test_config_docs.py loads each one)
SET_EXAMPLES = {
    "broker": "eval.every_versions=10",
    "reward": "port=8091",
    "generator": "sampling.temperature=0.7",
    "learner": "lr=0.001",
}
CONFIG_DOC = "docs/config.md"


def _service_parser(sub, name: str, help_: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help=help_,
        description=f"{help_}. Every field, its default and bounds: {CONFIG_DOC} "
        f"(or `relay config docs`); precedence: defaults < --config < RELAY_<FIELD> "
        f"environment variables < --set.",
    )
    p.add_argument(
        "--config",
        help=f"JSON or TOML config file: this service's fields at the top level (the "
        f"{name} section of {CONFIG_DOC}), or a run file as `relay up --config` takes (sections "
        f"[broker], [reward], [generator], [learner], [weights]), of which it reads [{name}]",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"override a config field (nested with dots), e.g. --set {SET_EXAMPLES[name]}",
    )
    p.add_argument("--log-json", action="store_true", help="log as JSON lines")
    return p


def _load(model, args, service: str):
    """The service's config: defaults < --config < RELAY_* variables < --set; a RELAY_* variable that
    names no field of any service is refused (deploy/launcher/environment.py). ``--config`` takes a
    file of this service's fields, or a run file (``relay up --config``: ``[broker]``, ``[reward]``,
    ``[generator]``, ``[learner]``, ``[weights]``), of which it reads this service's section."""
    import os

    from deploy.launcher.environment import refuse_unknown

    refuse_unknown(os.environ)
    return load_config(model, args.config, set_overrides(args.set), pick=lambda data: _section(data, service, model))


def _section(data: dict, service: str, model) -> dict:
    """``data`` itself when it is a service file; the ``service`` section (with the run-wide sections it
    takes, as ``relay up`` gives them) when it is a run file: only run-file sections at its top level,
    none of them a field of ``model``."""
    from deploy.launcher.plan import SERVICES, SHARED, _shared_sections

    sections = set(SERVICES) | set(SHARED)
    if not data or not set(data) <= sections or set(data) & set(model.model_fields):
        return data
    return _shared_sections(data).get(service, {})


def cmd_broker(args) -> int:
    from broker.config import BrokerConfig

    cfg = _load(BrokerConfig, args, "broker")
    from broker.runtime.logs import setup_logging
    from broker.service import Broker

    setup_logging("broker", "0", as_json=args.log_json)
    b = Broker(cfg, log_json=args.log_json)
    b.serve_http()
    _stop_on_signals(b.stop_event.set)
    b.run()
    return 0


def cmd_reward(args) -> int:
    from reward_service.app import RewardConfig

    cfg = _load(RewardConfig, args, "reward")
    import uvicorn

    from broker.runtime.logs import setup_logging
    from reward_service.app import create_app

    setup_logging("reward", "0", as_json=args.log_json)
    from broker.runtime.ports import handed_over

    sock = handed_over(cfg.host, cfg.port)  # the socket relay up bound for it (broker/runtime/ports.py)
    if sock is None:
        uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level="warning", access_log=False)
        return 0
    server = uvicorn.Server(
        uvicorn.Config(create_app(cfg), host=cfg.host, port=cfg.port, log_level="warning", access_log=False)
    )
    server.run(sockets=[sock])
    return 0 if server.started else 3


def cmd_generator(args) -> int:
    from generators.config import GeneratorConfig

    cfg = _load(GeneratorConfig, args, "generator")
    from broker.runtime.logs import setup_logging

    setup_logging("generator", cfg.id, as_json=args.log_json)
    from generators.service import Generator

    Generator(cfg).run()
    return 0


def cmd_learner(args) -> int:
    from learner.config import LearnerConfig, lr_problems

    cfg = _load(LearnerConfig, args, "learner")
    error, warnings = lr_problems(cfg)  # relay up checks them before anything starts (deploy/launcher/preflight.py)
    if error:
        raise ConfigError(error)
    if args.nnodes is not None:  # this node's part of a learner across nodes: torchrun's agent runs the ranks
        from deploy.launcher import nodes

        if problem := nodes.node_problem(args):
            raise ConfigError(problem)
        return nodes.run_node(args, nodes.worker_args(args))
    from broker.runtime.logs import setup_logging

    setup_logging("learner", "0", as_json=args.log_json)
    if os.environ.get("RELAY_LEARNER_NODES") == "1":  # a rank of a node's agent (deploy/launcher/nodes.py)
        from deploy.launcher.procs import _die_with_parent

        _die_with_parent()  # it ends with its node
    for w in warnings:
        logging.getLogger("relay.learner").warning(w)
    from learner.engine import close_distributed
    from learner.trainer import Learner

    Learner(cfg).run()
    close_distributed()
    return 0


def cmd_export(args) -> int:
    from deploy.export import run_export

    return run_export(args)


def cmd_status(args) -> int:
    from deploy.status import run_status

    return run_status(args)


def cmd_config(args) -> int:
    from deploy.configdoc import run_config

    return run_config(args)


def cmd_secrets(args) -> int:
    from deploy.provision import run

    return run(args)


def cmd_up(args) -> int:
    from deploy.launcher.up import run_up

    return run_up(args)


def cmd_bench(args) -> int:
    from benchmarks.run import main as run_bench

    return run_bench(args.names, args.quick, args.json, args.md, args.vllm, args.sglang)


def _stop_on_signals(fn) -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: fn())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relay", description="Relay: asynchronous RL for language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_up(sub)
    _add_services(sub)
    _add_bench(sub)
    _add_run_tools(sub)
    _add_deployment_tools(sub)
    return parser


def _add_up(sub) -> None:
    """``relay up``: the whole stack (its arguments: deploy/launcher/up_arguments.py)."""
    from deploy.launcher.up import add_up_arguments

    up = sub.add_parser(
        "up",
        help="run the whole stack on this machine",
        description="Run Redis, the broker, the reward service, generators and the learner "
        "as child processes; write runs/<run-id>/ and runs/latest.",
    )
    add_up_arguments(up)
    up.set_defaults(fn=cmd_up)


def _add_services(sub) -> None:
    """One service each (what ``relay up``, Compose and Kubernetes run)."""
    _service_parser(
        sub, "broker", "ZeroMQ ingest -> Redis trajectories stream; prompt feeder; HTTP state"
    ).set_defaults(fn=cmd_broker)
    _service_parser(sub, "reward", "the HTTP reward service").set_defaults(fn=cmd_reward)
    _service_parser(sub, "generator", "one generator replica").set_defaults(fn=cmd_generator)
    from deploy.launcher.nodes import add_node_arguments

    learner = _service_parser(sub, "learner", "the DeepSpeed learner")
    add_node_arguments(learner)
    learner.set_defaults(fn=cmd_learner)


def _add_bench(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmark every stage against its raw baseline",
        description="Run the benchmarks (all, or those named), each against a raw baseline "
        "measured side by side; print a Markdown table (docs/benchmarks.md).",
    )
    bench.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="codec, ingest, ingest_scaling, weight_sync, fanout, overlap, async_speedup, generator, learner, "
        "learner_memory, learner_forwards, long_context; peer by name only (default: all)",
    )
    bench.add_argument("--quick", action="store_true", help="tiny sizes, seconds (no vLLM rows unless --vllm)")
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument("--md", metavar="PATH", help="write the Markdown table")
    bench.add_argument(
        "--vllm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the vLLM rows (default: yes, except with --quick)",
    )
    bench.add_argument(
        "--sglang",
        action="store_true",
        help="add the generator/sglang row: SGLang servers from SGLang's own environment (RELAY_SGLANG_PYTHON, "
        "else .cache/sglang-venv; make sglang-env)",
    )
    bench.set_defaults(fn=cmd_bench)


def _add_run_tools(sub) -> None:
    """What reads a run: its state, its trained model."""
    from deploy.export import add_export_arguments
    from deploy.status import add_status_arguments

    status = sub.add_parser(
        "status",
        help="print the run's state as a table",
        description="The dashboard's state as a table: learner version, every generator's "
        "version, hash, lag and state, the queue, failures. With RUN (a run "
        "folder, or a run id or 'latest' under --runs-dir): a finished run's "
        "report from its summary.json, or the state of the run while it goes.",
    )
    add_status_arguments(status)
    status.set_defaults(fn=cmd_status)
    exp = sub.add_parser(
        "export",
        help="write a run's trained model as a Hugging Face folder",
        description="Copy a published version of a run (default: the newest) into a standard "
        "Hugging Face folder (config, tokenizer, safetensors), each file checked "
        "against the snapshot's sha256 manifest.",
    )
    add_export_arguments(exp)
    exp.set_defaults(fn=cmd_export)


def _add_deployment_tools(sub) -> None:
    """The config reference and a run's effective config; the secrets of a deployment."""
    from deploy.configdoc import add_config_arguments
    from deploy.provision import add_arguments as add_secrets_arguments

    config = sub.add_parser(
        "config",
        help="the config reference (docs/config.md) and a run's effective config",
        description="`relay config docs` prints docs/config.md (every field of every service, "
        "generated from the models); `relay config show RUN` prints the effective "
        "config a run's services ran with.",
    )
    add_config_arguments(config)
    config.set_defaults(fn=cmd_config)
    sec = sub.add_parser(
        "secrets",
        help="make the secrets of a Compose or Kubernetes deployment",
        description="Keys and passwords for docker-compose.yml (deploy/secrets) and, with --k8s, "
        "the Kubernetes Secrets of deploy/k8s: the announcement key pair, the weights "
        "key, the ingest's CURVE certificates, Redis users, the reward token "
        "(docs/deploy.md, docs/security.md).",
    )
    add_secrets_arguments(sec)
    sec.set_defaults(fn=cmd_secrets)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"relay {args.command}: {e}", file=sys.stderr)
        return 2
    except (OSError, ConnectionError) as e:  # a port in use, Redis unreachable, a missing folder
        print(f"relay {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
