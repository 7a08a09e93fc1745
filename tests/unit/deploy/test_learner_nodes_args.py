"""``relay learner --nnodes``'s options (deploy/launcher/nodes.py): what is refused, and the torchrun command
each node runs (the c10d rendezvous joined as a client on every node, the node's address as torchrun's)."""

from deploy.cli import build_parser
from deploy.launcher import nodes


def _args(*extra: str):
    return build_parser().parse_args(["learner", "--config", "run.toml", "--set", "lr=0.001", *extra])


def test_without_nnodes_the_learner_is_one_process_as_before():
    assert _args().nnodes is None


def test_bad_node_options_are_named():
    assert "--node-rank must be in 0..1" in nodes.node_problem(_args("--nnodes", "2", "--node-rank", "2"))
    assert "HOST:PORT" in nodes.node_problem(_args("--nnodes", "2", "--rdzv-endpoint", "learner-0"))
    assert "at least 1" in nodes.node_problem(_args("--nnodes", "0"))
    assert nodes.node_problem(_args("--nnodes", "2", "--node-rank", "1")) is None


def test_each_node_runs_torchrun_with_the_learners_own_options():
    a = _args("--nnodes", "2", "--node-rank", "1", "--node-addr", "learner-1.nodes", "--rdzv-endpoint", "l0:29400")
    argv = nodes.torchrun_argv(a, nodes.worker_args(a))
    assert argv[: argv.index("-m")] == [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=l0:29400",
        "--rdzv-id=relay-learner",
        "--rdzv-conf=is_host=false,join_timeout=600",  # node 0's launcher hosts the store, bound to one address
        "--local-addr=learner-1.nodes",
        "--max-restarts=3",
        "--monitor-interval=1",
    ]
    assert argv[argv.index("-m") :] == ["-m", "deploy.cli", "learner", "--config", "run.toml", "--set", "lr=0.001"]
    assert nodes.split_endpoint("[::1]:29400") == ("::1", 29400)


def test_a_loopback_address_keeps_gloo_on_the_loopback_interface():
    assert nodes.interface_of("127.0.0.2") == "lo" and nodes.interface_of("127.0.0.1") == "lo"
