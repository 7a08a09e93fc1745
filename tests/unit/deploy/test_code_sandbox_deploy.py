"""The documented ways to run the code_exec sandbox in compose and Kubernetes (docs/deploy.md "The
code sandbox"): the compose override and the kustomize component render, validate, give the reward
service (and only it) what the sandbox needs, and mount a reward config that asks for cgroups."""

from __future__ import annotations

import shutil

import yaml

from broker.runtime.config import load_config
from reward_service.config import RewardConfig
from tests.unit.deploy.test_deploy import K8S, ROOT, _compose, _docs, _run, _tool

OVERRIDE = ROOT / "deploy" / "compose" / "code-sandbox.yml"
COMPONENT = K8S / "components" / "code-sandbox"


def _asks_for_the_cgroup_sandbox(path) -> None:
    cfg = load_config(RewardConfig, path, environ={})
    (code,) = [p for p in cfg.plugins.values() if p.type == "code_exec"]
    assert code.options.get("isolation", "cgroup") == "cgroup"  # never a silent rlimits-only fallback


def test_the_compose_override_gives_the_reward_service_what_the_sandbox_needs():
    r = _compose("-f", str(OVERRIDE), "config")
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    reward = services["reward"]
    assert reward["privileged"] is True and reward["user"] == "0:0" and reward["cgroup"] == "private"
    assert not any(s.get("privileged") for name, s in services.items() if name != "reward")
    (mount,) = [v for v in reward["volumes"] if v["target"] == "/etc/relay/reward.toml"]
    assert mount["source"].endswith("deploy/compose/reward-code.toml") and mount["read_only"]
    _asks_for_the_cgroup_sandbox(mount["source"])


def test_the_kubernetes_component_renders_and_validates(tmp_path):
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s)
    overlay = k8s / "overlays" / "sandbox"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - ../../base\n"
        "components:\n  - ../../components/code-sandbox\n"
    )
    r = _run(_tool("kubectl"), "kustomize", str(overlay))
    assert r.returncode == 0, r.stderr
    (tmp_path / "out.yaml").write_text(r.stdout)
    v = _run(_tool("kubernetes-validate"), "--strict", "--quiet", str(tmp_path / "out.yaml"))
    assert v.returncode == 0, v.stdout + v.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _docs(tmp_path / "out.yaml")}
    pod = docs[("Deployment", "reward")]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 0 and pod["containers"][0]["securityContext"]["privileged"]
    assert pod["nodeSelector"] == {"relay.dev/code-sandbox": "true"}  # only on nodes given to it
    for name in ("broker", "learner", "generator"):  # the others stay unprivileged
        assert docs[("Deployment", name)]["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    text = docs[("ConfigMap", "reward-config")]["data"]["reward.toml"]
    assert text == (COMPONENT / "reward.toml").read_text() == (ROOT / "deploy/compose/reward-code.toml").read_text()
    _asks_for_the_cgroup_sandbox(COMPONENT / "reward.toml")
