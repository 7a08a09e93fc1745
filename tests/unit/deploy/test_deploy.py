"""The deployment files, validated offline by the real tools (docs/deploy.md):

- docker-compose.yml against the compose specification (check-jsonschema) and by the Compose v2
  CLI (`docker compose config`, no engine needed), for the default profile and the GPU ones;
- every Kubernetes manifest rendered from deploy/k8s/overlays/* (`kubectl kustomize`) with
  `kubernetes-validate --strict`;
- what the schemas cannot see: every RELAY_* variable names a real config field of the service
  it is given to, probes hit the port the service listens on, tokens come from secrets only,
  pods run as non-root with resource requests, the network policies select pods that exist.

A broken file must fail each tool (the negative tests), so a passing run means something.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
import yaml

from broker.runtime.config import load_config
from broker.config import BrokerConfig
from generators.config import GeneratorConfig
from learner.config import LearnerConfig
from reward_service.config import RewardConfig
from tests.support.services import ROOT

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
# overlays with the http weight transport (components/weights-http): no shared weight volume
HTTP_OVERLAYS = {
    o for o in OVERLAYS if "components/weights-http" in (K8S / "overlays" / o / "kustomization.yaml").read_text()
}
# overlays with the learner across nodes (components/learner-nodes): a StatefulSet of torchrun nodes
NODES_OVERLAYS = {
    o for o in OVERLAYS if "components/learner-nodes" in (K8S / "overlays" / o / "kustomization.yaml").read_text()
}
MODELS = {"broker": BrokerConfig, "reward": RewardConfig, "learner": LearnerConfig, "generator": GeneratorConfig}
TOKEN_VARS = {"RELAY_AUTH_TOKEN", "RELAY_REWARD_TOKEN"}
# the port each service serves /healthz on, by the config field that sets it
PORT_FIELD = {
    "broker": "RELAY_HTTP_PORT",
    "reward": "RELAY_PORT",
    "learner": "RELAY_METRICS__PORT",
    "generator": "RELAY_METRICS__PORT",
}


def _tool(name: str) -> str:
    """A console script of the test extra: next to this Python first, then on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        how = (
            "a kubectl binary on PATH (kubectl kustomize renders the overlays)"
            if name == "kubectl"
            else "pip install -e '.[test]' installs it"
        )
        pytest.skip(f"{name} is not installed ({how})")
    return found


def _run(*cmd: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


_PROJECTS: dict[bool, Path] = {}


def _project(with_secrets: bool = True) -> Path:
    """The compose project as a user has it: the repository (linked, so relative paths such as
    ./deploy/config/... resolve to its files), with ``deploy/secrets`` made by the real `relay secrets`
    command, or without any secret."""
    if with_secrets not in _PROJECTS:
        d = Path(tempfile.mkdtemp(prefix="relay-compose-"))
        for p in ROOT.iterdir():
            if p.name != "deploy":
                (d / p.name).symlink_to(p)
        (d / "deploy").mkdir()
        for p in (ROOT / "deploy").iterdir():
            if p.name != "secrets":
                (d / "deploy" / p.name).symlink_to(p)
        if with_secrets:
            r = _run(sys.executable, "-m", "deploy.cli", "secrets", str(d / "deploy" / "secrets"))
            assert r.returncode == 0, r.stdout + r.stderr
        _PROJECTS[with_secrets] = d
    return _PROJECTS[with_secrets]


def _compose(*args: str, file: Path | None = None, with_secrets: bool = True) -> subprocess.CompletedProcess:
    project = _project(with_secrets)
    cmd = [
        _tool("docker-compose"),
        "--project-directory",
        str(project),
        "-f",
        str(file or project / "docker-compose.yml"),
    ]
    return _run(*cmd, *args, env={"DOCKER_CONFIG": str(ROOT / ".cache" / "docker")})


# -- docker compose -----------------------------------------------------------------------------


def test_compose_file_matches_the_compose_spec():
    r = _run(_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", "docker-compose.yml")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "profile,expected",
    [
        (None, {"redis", "broker", "reward", "learner", "generator"}),  # COMPOSE_PROFILES=cpu from .env
        ("vllm", {"redis", "broker", "reward", "learner", "generator-vllm"}),
        ("sglang", {"redis", "broker", "reward", "learner", "sglang", "generator-sglang"}),
    ],
)
def test_docker_compose_config_accepts_every_profile(profile, expected):
    args = ["--profile", profile] if profile else []
    r = _compose(*args, "config", "-q")
    assert r.returncode == 0, r.stderr
    services = _compose(*args, "config", "--services")
    assert set(services.stdout.split()) == expected, services.stderr


def test_compose_validators_reject_a_broken_file(tmp_path):
    broken = (ROOT / "docker-compose.yml").read_text().replace("depends_on:", "depends_onn:", 1)
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(broken)
    assert _run(_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)).returncode != 0
    r = _compose("config", "-q", file=bad)
    assert r.returncode != 0 and "depends_onn" in r.stderr


def test_compose_wiring():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert "appendonly" in " ".join(services["redis"]["command"])
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"])
    for name in MODELS:
        s = services[name]
        assert s["restart"] in ("unless-stopped", "on-failure"), name
        assert "healthcheck" in s, f"{name} has no healthcheck"
        port = str(s["environment"][PORT_FIELD[name]])
        assert f":{port}/healthz" in " ".join(s["healthcheck"]["test"]), f"{name}: healthcheck misses port {port}"
        assert not TOKEN_VARS & set(s["environment"]), f"{name}: a token belongs in the env file, not the compose file"
    builders = [n for n, s in services.items() if "build" in s and s["image"] == services["broker"]["image"]]
    assert builders == ["broker"], "one service builds the image (several would build it in parallel)"
    # the vllm profile's generators run the engine in their own process: a GPU each, vLLM in the image
    vllm = services["generator-vllm"]
    assert vllm["build"]["args"]["EXTRA_PACKAGES"] == "vllm" and vllm["deploy"]["resources"]["reservations"]["devices"]
    assert services["generator-sglang"]["environment"]["RELAY_BACKEND__URL"] == "http://sglang:30000"
    assert "weights:/weights:ro" in services["sglang"]["volumes"]  # the server reads the snapshots announced
    assert {services[n]["image"] for n in MODELS} == {services["broker"]["image"]}
    for name in ("reward", "generator"):
        assert "deploy/secrets/relay.env" in [e["path"] for e in services[name]["env_file"]]
    # authentication on: each service's Redis user from its env file, CURVE keys and the announcement key
    # from compose secrets (made by `relay secrets deploy/secrets`), no insecure ingest anywhere
    assert "--aclfile" in services["redis"]["command"] and "redis_acl" in services["redis"]["secrets"]
    for name in ("broker", "learner", "generator", "generator-vllm", "generator-sglang"):
        env = services[name]["environment"]
        assert "RELAY_REDIS_URL" not in env and "RELAY_INGEST_AUTH" not in env, name
        assert f"deploy/secrets/{name.split('-')[0]}.env" in [e["path"] for e in services[name]["env_file"]], name
        # the private announcement key is the learner's alone: whoever steals a generator's (or the broker's)
        # files cannot sign a version; the weights key goes to who reads weights (learner, generators)
        want = (
            {"announce_key", "weights_key"}
            if name == "learner"
            else {"announce_public"} | ({"weights_key"} if name.startswith("generator") else set())
        )
        assert want == set(services[name]["secrets"]) & {"announce_key", "announce_public", "weights_key"}, name
        assert ("RELAY_ANNOUNCE_KEY_FILE" in env) == (name == "learner"), name
        assert ("RELAY_ANNOUNCE_PUBLIC_KEY_FILE" in env) != (name == "learner"), name
    assert {"ingest_broker_key", "ingest_clients"} <= set(services["broker"]["secrets"])
    assert {"ingest_generator_key", "ingest_broker_public"} <= set(services["generator"]["secrets"])
    assert all(v["file"].startswith("deploy/secrets/") for v in compose["secrets"].values())
    assert services["generator"]["depends_on"]["reward"]["condition"] == "service_healthy"
    # learner and generators share the weight store at the same path (announcements carry the path)
    assert services["learner"]["environment"]["RELAY_WEIGHT_STORE"] == "/weights"
    assert "weights:/weights:ro" in services["generator"]["volumes"]
    # the mounted config file exists and is a valid reward config
    mount = next(v for v in services["reward"]["volumes"] if v.endswith(":ro")).split(":")[0]
    load_config(RewardConfig, ROOT / mount)
    # secrets are never sent into an image build
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "deploy/secrets" in ignored and ".env" in ignored


def test_compose_http_override_shares_no_weight_volume():
    """docker compose -f docker-compose.yml -f deploy/compose/weights-http.yml: the generators mount no volume
    (the learner's weight volume is its own), both sides use the http transport, the URL names the learner."""
    r = _compose("-f", str(ROOT / "deploy" / "compose" / "weights-http.yml"), "config")
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    assert not services["generator"].get("volumes")
    genv, lenv = services["generator"]["environment"], services["learner"]["environment"]
    assert genv["RELAY_WEIGHTS__TRANSPORT__TYPE"] == lenv["RELAY_WEIGHTS__TRANSPORT__TYPE"] == "http"
    assert lenv["RELAY_WEIGHTS__TRANSPORT__ADVERTISE_URL"] == f"http://learner:{lenv['RELAY_WEIGHTS__TRANSPORT__PORT']}"
    mounts = [(v["source"], v["target"]) for s in services.values() for v in s.get("volumes", [])]
    assert [m for m in mounts if m[0] == "weights"] == [("weights", "/weights")]  # the learner's alone
    for name in ("learner", "generator"):
        load_config(MODELS[name], None, environ={k: str(v) for k, v in services[name]["environment"].items()})


def test_compose_learner_nodes_are_two_torchrun_nodes_on_a_network_of_their_own():
    """docker compose -f docker-compose.yml -f deploy/compose/weights-http.yml -f deploy/compose/learner-nodes.yml:
    the single learner is off; learner-0 and learner-1 run `relay learner --nnodes 2` with node ranks 0 and 1,
    meet at learner-0's rendezvous on an internal network only they join, learner-0 alone is `learner` to the
    generators (the http weights), both share the learner's volumes, and no generator mounts a volume."""
    from deploy.cli import build_parser

    compose = ROOT / "deploy" / "compose"
    r = _compose("-f", str(compose / "weights-http.yml"), "-f", str(compose / "learner-nodes.yml"), "config")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    services = cfg["services"]
    assert "learner" not in services and {"learner-0", "learner-1"} <= set(services)
    nodes = {name: build_parser().parse_args(services[name]["command"][1:]) for name in ("learner-0", "learner-1")}
    assert [a.node_rank for a in nodes.values()] == [0, 1] and {a.nnodes for a in nodes.values()} == {2}
    assert len({a.rdzv_endpoint for a in nodes.values()}) == 1
    host = nodes["learner-0"].rdzv_endpoint.rpartition(":")[0]
    assert cfg["networks"]["learner-nodes"]["internal"] is True
    on_nodes = {n for n, s in services.items() if "learner-nodes" in (s.get("networks") or {})}
    assert on_nodes == {"learner-0", "learner-1"}
    for name, args in nodes.items():
        assert services[name]["networks"]["learner-nodes"]["aliases"] == [args.node_addr]
    assert host == nodes["learner-0"].node_addr  # node 0 hosts the rendezvous on its own name
    assert sorted(a.node_addr for a in nodes.values()) == [nodes["learner-0"].node_addr, nodes["learner-1"].node_addr]
    aliases = {n: (s.get("networks") or {}).get("default", {}) or {} for n, s in services.items()}
    assert [n for n, a in aliases.items() if "learner" in (a.get("aliases") or [])] == ["learner-0"]
    assert all(not services[g].get("volumes") for g in services if g.startswith("generator"))
    mounts = {
        n: {(v["source"], v["target"]) for v in s.get("volumes", []) if v["type"] == "volume"}
        for n, s in services.items()
    }
    assert mounts["learner-0"] == mounts["learner-1"] >= {("runs", "/runs")}
    for name in ("learner-0", "learner-1"):
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        assert env["RELAY_WEIGHTS__TRANSPORT__TYPE"] == "http" and services[name]["secrets"]
        load_config(LearnerConfig, None, environ=env)


def test_compose_refuses_to_start_without_the_secrets_and_accepts_what_relay_secrets_makes(tmp_path):
    r = _compose("config", "-q", with_secrets=False)
    assert r.returncode != 0 and "deploy/secrets/" in r.stderr, r.stderr
    assert _compose("config", "-q").returncode == 0
    made = _project() / "deploy" / "secrets"
    assert oct(made.stat().st_mode & 0o777) == "0o700"
    services = yaml.safe_load(_compose("config").stdout)["services"]
    urls = {}
    for name in ("broker", "learner", "generator"):
        urls[name] = services[name]["environment"]["RELAY_REDIS_URL"]
        assert urls[name].startswith(f"redis://{name}:") and urls[name].endswith("@redis:6379/0")
    assert len(set(urls.values())) == 3  # one user and password each
    # run again: nothing changes (the deployment keeps its keys)
    before = {p: p.read_bytes() for p in made.rglob("*") if p.is_file()}
    r = _run(sys.executable, "-m", "deploy.cli", "secrets", str(made))
    assert r.returncode == 0 and before == {p: p.read_bytes() for p in made.rglob("*") if p.is_file()}


def test_compose_binds_0_0_0_0_only_with_the_authentication_on():
    """Inside its containers compose binds every listener on 0.0.0.0; each service's config as `docker compose
    config` renders it (the env files of `relay secrets` included) passes the refusal of an open bind without
    authentication (broker/runtime/binds.py): the ingest under CURVE, the reward service with its token."""
    services = yaml.safe_load(_compose("config").stdout)["services"]
    cfgs = {}
    for name, model in MODELS.items():
        env = {k: str(v) for k, v in services[name]["environment"].items() if k.startswith("RELAY_")}
        mount = ROOT / "deploy" / "config" / "reward.toml" if name == "reward" else None
        cfgs[name] = load_config(model, mount, environ=env)
    assert cfgs["broker"].ingest_bind.startswith("tcp://0.0.0.0:") and cfgs["broker"].ingest_auth == "curve"
    assert cfgs["reward"].host == "0.0.0.0" and len(cfgs["reward"].auth_token) >= 32
    assert cfgs["generator"].reward_token == cfgs["reward"].auth_token
    assert not any(c.allow_unauthenticated_bind for n, c in cfgs.items() if n != "generator")


# -- Kubernetes ---------------------------------------------------------------------------------


def _render(overlay: str) -> str:
    r = _run(_tool("kubectl"), "kustomize", str(K8S / "overlays" / overlay))
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("k8s")
    files = {}
    for overlay in OVERLAYS:
        files[overlay] = out / f"{overlay}.yaml"
        files[overlay].write_text(_render(overlay))
    return files


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_there_are_cpu_and_gpu_overlays():
    assert {"cpu", "gpu", "cpu-ingest-workers"} <= set(OVERLAYS) and "cpu-http" in HTTP_OVERLAYS


def test_http_overlay_shares_no_weight_volume_and_wires_the_weight_server(rendered):
    """kubectl kustomize deploy/k8s/overlays/cpu-http: no ReadWriteMany claim, no persistent volume in the
    generators, the learner serves its store on the port its Service and the policies open, and the URL the
    generators are given names that Service."""
    docs = _docs(rendered["cpu-http"])
    assert {d["spec"]["accessModes"][0] for d in docs if d["kind"] == "PersistentVolumeClaim"} == {"ReadWriteOnce"}
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    gen = deps["generator"]["spec"]["template"]["spec"]
    assert not [v for v in gen["volumes"] if "persistentVolumeClaim" in v]
    genv = {e["name"]: e.get("value") for e in gen["containers"][0]["env"]}
    assert genv["RELAY_WEIGHTS__TRANSPORT__TYPE"] == "http" and "RELAY_WEIGHT_STORE" not in genv
    cache = genv["RELAY_WEIGHTS__TRANSPORT__CACHE_DIR"]
    assert cache in {m["mountPath"] for m in gen["containers"][0]["volumeMounts"] if not m.get("readOnly")}
    lc = deps["learner"]["spec"]["template"]["spec"]["containers"][0]
    lenv = {e["name"]: e.get("value") for e in lc["env"]}
    assert lenv["RELAY_WEIGHTS__TRANSPORT__TYPE"] == "http" and lenv["RELAY_WEIGHTS__TRANSPORT__HOST"] == "0.0.0.0"
    port = int(lenv["RELAY_WEIGHTS__TRANSPORT__PORT"])
    assert {p["name"]: p["containerPort"] for p in lc["ports"]}["weights"] == port
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "learner")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["weights"] == port
    assert lenv["RELAY_WEIGHTS__TRANSPORT__ADVERTISE_URL"] == f"http://learner:{port}"
    assert lenv["RELAY_WEIGHT_STORE"].startswith("/runs/")  # in the learner's own (ReadWriteOnce) volume
    assert "/runs" in {m["mountPath"] for m in lc["volumeMounts"]}
    pol = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    assert any(
        r.get("to", [{}])[0].get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name") == "learner"
        and r["ports"][0]["port"] == port
        for r in pol["generator"]["spec"]["egress"]
    )
    assert any(r["ports"][0]["port"] == port for r in pol["learner"]["spec"]["ingress"])


def test_ingest_workers_overlay_wires_every_worker_port_through_service_generators_and_policies(rendered):
    """kubectl kustomize deploy/k8s/overlays/cpu-ingest-workers: the broker runs N ingest workers, and each
    worker's port (what BrokerConfig binds and advertises for them) is a container port, a Service port,
    an address every generator sends to, and open in both network policies."""
    docs = _docs(rendered["cpu-ingest-workers"])
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    bc = deps["broker"]["spec"]["template"]["spec"]["containers"][0]
    benv = {e["name"]: e.get("value", "secret") for e in bc["env"]}
    broker = load_config(BrokerConfig, None, environ=benv)
    assert broker.ingest_workers >= 2
    ports = [int(a.rpartition(":")[2]) for a in broker.ingest_binds()]
    by_port = {p["containerPort"]: p["name"] for p in bc["ports"]}
    assert set(ports) <= set(by_port), (ports, by_port)
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "broker")
    assert {(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} >= {(p, by_port[p]) for p in ports}
    genv = {e["name"]: e.get("value") for e in deps["generator"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (
        genv["RELAY_BROKER_ADDRESS"].split(",") == broker.advertised_ingests() == [f"tcp://broker:{p}" for p in ports]
    )
    pol = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}

    def opened(rules: list[dict], app: str) -> set[int]:
        return {
            n
            for r in rules
            for peer in r.get("to", r.get("from", []))
            if peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name") == app
            for p in r["ports"]
            for n in range(p["port"], p.get("endPort", p["port"]) + 1)
        }

    assert set(ports) <= opened(pol["broker"]["ingress"], "generator")
    assert set(ports) <= opened(pol["generator"]["egress"], "broker")


def test_learner_nodes_overlay_wires_the_rendezvous_the_leader_and_a_shared_checkpoint_volume(rendered):
    """kubectl kustomize deploy/k8s/overlays/cpu-http-learner-nodes: the learner is a StatefulSet of as many pods
    as `relay learner --nnodes` says, each one node (its pod index its --node-rank, its name under the headless
    Service its --node-addr), meeting at learner-0's rendezvous through that Service's port; the learner Service
    (the http weights, /metrics) selects learner-0, where rank 0 runs; only learner pods reach learner pods on
    any port; the checkpoints' volume is shared by the learner's pods only and no generator mounts a claim."""
    from deploy.cli import build_parser

    assert "cpu-http-learner-nodes" in NODES_OVERLAYS & HTTP_OVERLAYS
    docs = _docs(rendered["cpu-http-learner-nodes"])
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "learner"]
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    args = build_parser().parse_args(
        [a.replace("$(NODE_RANK)", "1").replace("$(POD_NAME)", "learner-1") for a in c["args"][1:]]
    )
    assert args.nnodes == sts["spec"]["replicas"] >= 2 and args.node_rank == 1
    assert sts["spec"]["podManagementPolicy"] == "Parallel" and "strategy" not in sts["spec"]
    svc = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    headless = svc[sts["spec"]["serviceName"]]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert headless["selector"] == sts["spec"]["selector"]["matchLabels"]
    host, _, port = args.rdzv_endpoint.rpartition(":")
    assert (
        host == f"learner-0.{sts['spec']['serviceName']}"
        and args.node_addr == f"learner-1.{sts['spec']['serviceName']}"
    )
    (rdzv,) = [p for p in headless["ports"] if p["name"] == "rendezvous"]
    assert rdzv["port"] == int(port) and {p["name"]: p["containerPort"] for p in c["ports"]}["rendezvous"] == int(port)
    assert svc["learner"]["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "learner-0"
    pol = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}["learner-nodes"]
    learner = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "learner"}}}
    assert pol["podSelector"] == learner["podSelector"] and set(pol["policyTypes"]) == {"Ingress", "Egress"}
    assert pol["ingress"] == [{"from": [learner]}] and pol["egress"] == [{"to": [learner]}]
    claims = {d["metadata"]["name"]: d["spec"]["accessModes"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    runs = next(v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v["name"] == "runs")
    assert claims[runs] == ["ReadWriteMany"] and "relay-weights" not in claims
    env_runs = next(e["value"] for e in c["env"] if e["name"] == "RELAY_RUN_DIR")
    assert env_runs.startswith(next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "runs"))
    gen = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "generator")
    assert not [v for v in gen["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_manifests_pass_kubernetes_validate_strict(rendered, overlay):
    r = _run(_tool("kubernetes-validate"), "--strict", "--quiet", str(rendered[overlay]))
    assert r.returncode == 0, r.stdout + r.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in _docs(rendered[overlay])}
    assert {
        ("StatefulSet", "redis"),
        ("Deployment", "broker"),
        ("Deployment", "reward"),
        ("StatefulSet" if overlay in NODES_OVERLAYS else "Deployment", "learner"),
        ("Deployment", "generator"),
        ("NetworkPolicy", "default-deny"),
    } <= kinds
    # the shared weight volume: in every overlay but those of the http weight transport
    assert (("PersistentVolumeClaim", "relay-weights") in kinds) == (overlay not in HTTP_OVERLAYS)


def test_kubernetes_validate_rejects_an_unknown_field(rendered, tmp_path):
    docs = _docs(rendered["cpu"])
    dep = next(d for d in docs if d["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}  # a typo of livenessProbe
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(dep))
    r = _run(_tool("kubernetes-validate"), "--strict", "--quiet", str(bad))
    assert r.returncode != 0 and "livenessprobe" in r.stdout + r.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_workloads_env_probes_security(rendered, overlay):
    docs = _docs(rendered[overlay])
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    assert set(workloads) == {"redis", *MODELS}
    for name, w in workloads.items():
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        for c in pod["containers"]:
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], name
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert "readinessProbe" in c or "startupProbe" in c, name
        if name == "redis":
            assert "--appendonly" in pod["containers"][0]["args"]
            assert w["spec"]["volumeClaimTemplates"], "redis needs a persistent volume"
            continue
        (c,) = pod["containers"]
        assert c["args"][:2] == ["relay", name]
        env = {e["name"]: e for e in c["env"]}
        for key, e in env.items():
            if key.startswith("RELAY_"):
                field = key[len("RELAY_") :].lower().split("__")[0]
                assert field in MODELS[name].model_fields, f"{overlay}/{name}: {key} names no config field"
            if key in TOKEN_VARS:
                assert "value" not in e and e["valueFrom"]["secretKeyRef"]["name"] == "relay-reward-token", key
        port = int(env[PORT_FIELD[name]]["value"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            if kind in c:
                assert c[kind]["httpGet"]["path"] == "/healthz"
                assert ports[c[kind]["httpGet"]["port"]] == port, f"{name}: {kind} is not on port {port}"
    # generators scale on their own: no fixed identity, the weight store shared read-many
    assert "RELAY_ID" not in {
        e["name"] for e in workloads["generator"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    if overlay not in HTTP_OVERLAYS:
        pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "relay-weights")
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # the env vars also load: each service's config validates with what the manifest sets
    for name, model in MODELS.items():
        c = workloads[name]["spec"]["template"]["spec"]["containers"][0]
        environ = {e["name"]: e.get("value", "secret") for e in c["env"]}
        path = ROOT / "deploy" / "config" / "reward.toml" if "--config" in c["args"] else None
        load_config(model, path, environ=environ)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_select_real_pods(rendered, overlay):
    docs = _docs(rendered[overlay])
    apps = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    default_deny = next(p for p in policies if p["metadata"]["name"] == "default-deny")
    assert default_deny["spec"]["podSelector"] == {} and set(default_deny["spec"]["policyTypes"]) == {
        "Ingress",
        "Egress",
    }

    def names(selector_holder: dict) -> set[str]:
        return (
            {selector_holder["podSelector"]["matchLabels"]["app.kubernetes.io/name"]}
            if "matchLabels" in selector_holder.get("podSelector", {})
            else set()
        )

    allowed_in: dict[str, set[str]] = {}
    for p in policies:
        target = names(p["spec"])
        assert target <= apps, p["metadata"]["name"]
        for rule in p["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                assert names(peer) <= apps
                for t in target:
                    allowed_in.setdefault(t, set()).update(names(peer))
    assert allowed_in["redis"] == {"broker", "learner", "generator"}
    assert allowed_in["reward"] == {"generator"}
    assert ("generator" in allowed_in.get("learner", set())) == (overlay in HTTP_OVERLAYS)  # the weight server
    assert "reward" not in allowed_in["redis"], "the reward service has no business with Redis"


def test_reward_configmap_is_the_compose_config_file():
    docs = _docs(K8S / "base" / "reward.yaml")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    text = (ROOT / "deploy" / "config" / "reward.toml").read_text()
    assert cm["data"]["reward.toml"] == text
    assert tomllib.loads(text)  # and it parses


def test_relay_secrets_k8s_writes_valid_secrets_with_every_key_the_manifests_read(rendered, tmp_path):
    """`relay secrets DIR --k8s FILE` (docs/deploy.md) writes Secrets that validate, and every Secret and
    key a rendered manifest reads (env secretKeyRef, secret volumes with the files the env points at)
    is among them."""
    out = tmp_path / "relay-secrets.yaml"
    r = _run(sys.executable, "-m", "deploy.cli", "secrets", str(tmp_path / "k8s-secrets"), "--k8s", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    v = _run(_tool("kubernetes-validate"), "--strict", "--quiet", str(out))
    assert v.returncode == 0, v.stdout + v.stderr
    made = {d["metadata"]["name"]: set(d["data"]) for d in _docs(out)}
    for overlay in OVERLAYS:
        for d in _docs(rendered[overlay]):
            if d["kind"] not in ("Deployment", "StatefulSet"):
                continue
            pod = d["spec"]["template"]["spec"]
            volumes = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
            for c in pod["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ref["key"] in made.get(ref["name"], ()), (overlay, d["metadata"]["name"], ref)
                mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", []) if m["name"] in volumes}
                files = [e["value"] for e in c.get("env", []) if e["name"].endswith("_FILE") and "value" in e]
                files += [a for a in c.get("args", []) if a.startswith("/etc/redis/")]
                for f in files:
                    folder, name = f.rsplit("/", 1)
                    assert folder in mounts, (overlay, d["metadata"]["name"], f)
                    assert name in made[mounts[folder]], (overlay, d["metadata"]["name"], f, mounts[folder])


# -- docs/deploy.md: every command in it is run by these tests or by make compose-smoke ----------

SMOKE = "deploy/compose_smoke.sh"
TESTS = "tests/unit/deploy/test_deploy.py"
# each command of the doc -> (the file that runs it, the fragment of that file that does)
DOC_COMMANDS = {
    ".venv/bin/pip wheel --constraint deploy/docker/constraints.txt --wheel-dir deploy/docker/wheelhouse torch==2.13.0 . setuptools wheel async-timeout": (
        SMOKE,
        '"$VENV/bin/pip" wheel -q --constraint deploy/docker/constraints.txt --wheel-dir "$WHEELHOUSE" '
        "torch==2.13.0 . setuptools wheel async-timeout",
    ),
    "debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python3-dev,ca-certificates,"
    "redis-server,g++ bookworm .cache/smoke/rootfs http://deb.debian.org/debian": (
        SMOKE,
        "debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python3-dev,"
        "ca-certificates,redis-server,g++",
    ),
    "tar -C .cache/smoke/rootfs -c . | docker import - local/relay-base:bookworm": (
        SMOKE,
        'tar -C "$WORK/rootfs" -c . | docker import - "$BASE_IMAGE"',
    ),
    "RELAY_BASE_IMAGE=local/relay-base:bookworm RELAY_REDIS_IMAGE=local/relay-base:bookworm docker compose build": (
        SMOKE,
        'export RELAY_BASE_IMAGE="$BASE_IMAGE" RELAY_REDIS_IMAGE="$BASE_IMAGE"',
    ),
    "relay secrets deploy/secrets": (SMOKE, '"$VENV/bin/relay" secrets deploy/secrets'),
    "docker compose up -d --scale generator=2": (SMOKE, "docker compose up -d --scale generator=2"),
    "relay status --url http://127.0.0.1:8080": (SMOKE, '"$VENV/bin/relay" status --url "$URL"'),
    "docker compose down -v": (SMOKE, "docker compose down -v"),
    "docker compose --profile vllm config --services": (
        TESTS,
        '("vllm", {"redis", "broker", "reward", "learner", "generator-vllm"})',
    ),
    "check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml": (
        TESTS,
        '"--builtin-schema", "vendor.compose-spec", "docker-compose.yml"',
    ),
    "docker compose config -q": (TESTS, 'r = _compose(*args, "config", "-q")'),
    "kubectl kustomize deploy/k8s/overlays/cpu": (TESTS, '"kustomize", str(K8S / "overlays" / overlay)'),
    "docker compose -f docker-compose.yml -f deploy/compose/code-sandbox.yml config": (
        "tests/unit/deploy/test_code_sandbox_deploy.py",
        '_compose("-f", str(OVERRIDE), "config")',
    ),
    "docker compose -f docker-compose.yml -f deploy/compose/weights-http.yml config": (
        TESTS,
        '_compose("-f", str(ROOT / "deploy" / "compose" / "weights-http.yml"), "config")',
    ),
    "relay up --learner-ranks 2 --learner-nodes 2": (
        "tests/integration/test_learner_nodes.py",
        '"--learner-ranks", "2", "--learner-nodes", "2"',
    ),
    "docker compose -f docker-compose.yml -f deploy/compose/weights-http.yml -f deploy/compose/learner-nodes.yml config": (
        TESTS,
        '_compose("-f", str(compose / "weights-http.yml"), "-f", str(compose / "learner-nodes.yml"), "config")',
    ),
    "docker compose -f docker-compose.yml -f deploy/compose/weights-http.yml -f deploy/compose/learner-nodes.yml up -d --scale generator=2": (
        SMOKE,
        "docker-compose.yml:deploy/compose/weights-http.yml:deploy/compose/learner-nodes.yml",
    ),
    "kubectl kustomize deploy/k8s/overlays/cpu-http-learner-nodes": (
        TESTS,
        '"kustomize", str(K8S / "overlays" / overlay)',
    ),
    "relay secrets .cache/k8s-secrets --k8s relay-secrets.yaml": (
        TESTS,
        '"secrets", str(tmp_path / "k8s-secrets"), "--k8s", str(out)',
    ),
}


def _doc_commands() -> tuple[list[str], list[str]]:
    """The commands of docs/deploy.md's bash blocks: (run here, marked **not run here**)."""
    run, not_run = [], []
    text = (ROOT / "docs" / "deploy.md").read_text()
    parts = text.split("```bash\n")
    for before, block in zip(parts, parts[1:]):
        marked = "**not run here**" in before.rstrip().rsplit("\n\n", 1)[-1]  # the paragraph above
        code = block.split("```", 1)[0].replace("\\\n", " ")
        for line in code.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                (not_run if marked else run).append(" ".join(line.split()))
    return run, not_run


def test_every_command_in_the_deploy_doc_is_run_by_a_test_or_the_smoke():
    run, not_run = _doc_commands()
    assert set(run) == set(DOC_COMMANDS), "a command in docs/deploy.md that nothing runs (or a stale entry here)"
    for command, (path, fragment) in DOC_COMMANDS.items():
        assert fragment in (ROOT / path).read_text(), f"{path} no longer runs: {command}"
    # the only commands allowed without a run: the ones that need a Kubernetes API server
    assert not_run and all(c.startswith("kubectl ") and "kustomize" not in c for c in not_run), not_run
