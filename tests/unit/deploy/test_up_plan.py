"""``relay up``'s plan: what each service is told, before anything starts (no process, no network)."""

import re
import subprocess
import sys

import pytest

from broker.runtime.config import ConfigError
from deploy.launcher import environment
from deploy.launcher.preflight import PreflightError
from tests.support.services import ROOT
from tests.support.up_plan import plan_up as _plan


def test_generators_reach_the_broker_and_reward_service_where_the_overrides_put_them(tmp_path):
    default = _plan(tmp_path, "--run-id", "a")
    assert default["generator"]["broker_address"] == default["broker"]["ingest_bind"]
    assert default["generator"]["reward"]["url"] == f"http://127.0.0.1:{default['reward']['port']}"

    moved = _plan(
        tmp_path, "--run-id", "b", "--set", "broker.ingest_bind=tcp://127.0.0.1:6123", "--set", "reward.port=6200"
    )
    assert moved["broker"]["ingest_bind"] == "tcp://127.0.0.1:6123"
    assert moved["generator"]["broker_address"] == "tcp://127.0.0.1:6123"
    assert moved["generator"]["reward"]["url"] == "http://127.0.0.1:6200"

    # bound on every interface: the generators on this machine connect through the loopback
    wildcard = _plan(
        tmp_path, "--run-id", "c", "--set", "broker.ingest_bind=tcp://0.0.0.0:6124", "--set", "reward.host=0.0.0.0"
    )
    assert wildcard["generator"]["broker_address"] == "tcp://127.0.0.1:6124"
    assert wildcard["generator"]["reward"]["url"] == f"http://127.0.0.1:{wildcard['reward']['port']}"

    # an explicit generator address still wins
    explicit = _plan(
        tmp_path,
        "--run-id",
        "d",
        "--set",
        "broker.ingest_bind=tcp://0.0.0.0:6125",
        "--set",
        "generator.broker_address=tcp://gateway:7000",
    )
    assert explicit["generator"]["broker_address"] == "tcp://gateway:7000"

    # several ingest workers: consecutive free ports from the launcher, every one given to the generators
    workers = _plan(tmp_path, "--run-id", "e", "--set", "broker.ingest_workers=3")
    base = int(workers["broker"]["ingest_bind"].rsplit(":", 1)[1])
    assert workers["generator"]["broker_address"] == ",".join(f"tcp://127.0.0.1:{base + k}" for k in range(3))
    wildcard = _plan(
        tmp_path, "--run-id", "f", "--set", "broker.ingest_workers=2", "--set", "broker.ingest_bind=tcp://0.0.0.0:6130"
    )
    assert wildcard["generator"]["broker_address"] == "tcp://127.0.0.1:6130,tcp://127.0.0.1:6131"
    with pytest.raises(ConfigError, match="ingest_workers"):
        _plan(tmp_path, "--run-id", "g", "--set", "broker.ingest_workers=2", "--set", "broker.ingest_bind=ipc:///tmp/x")


def test_one_precedence_order_defaults_file_environment_flags(tmp_path):
    """defaults < config file < RELAY_* < flags and --set; each service's effective config (written
    to runs/<id>/config/*.json) holds the environment's values."""
    (tmp_path / "run.toml").write_text(
        "[learner]\nsteps = 20\n[learner.batch]\ngroups = 8\n[generator.sampling]\nn = 4\n"
    )
    env = {"RELAY_STEPS": "4", "RELAY_SAMPLING__TEMPERATURE": "0.7", "RELAY_SEED": "5"}
    assert "steps" not in _plan(tmp_path, "--run-id", "b")["learner"]  # the model's default
    assert _plan(tmp_path, "--run-id", "c", "--config", str(tmp_path / "run.toml"))["learner"]["steps"] == 20
    p = _plan(tmp_path, "--run-id", "d", "--config", str(tmp_path / "run.toml"), environ=env)
    assert p["learner"]["steps"] == 4 and p["learner"]["batch"]["groups"] == 8  # the environment over the file
    assert p["generator"]["sampling"] == {"n": 4, "temperature": 0.7}  # recorded in the generator's config
    assert p["learner"]["seed"] == p["generator"]["seed"] == 5 and p["broker"]["task"]["seed"] == 5
    p = _plan(
        tmp_path, "--run-id", "e", "--config", str(tmp_path / "run.toml"), "--steps", "12", "--seed", "1", environ=env
    )
    assert p["learner"]["steps"] == 12  # the flag over the environment (it used to stop at 4 of 12)
    assert p["learner"]["seed"] == p["generator"]["seed"] == p["broker"]["task"]["seed"] == 1
    p = _plan(
        tmp_path,
        "--run-id",
        "f",
        "--steps",
        "12",
        "--set",
        "learner.steps=7",
        "--set",
        "generator.sampling.temperature=0.9",
        environ=env,
    )
    assert p["learner"]["steps"] == 7 and p["generator"]["sampling"]["temperature"] == 0.9
    # flags over the file too (the file used to win over --steps, --model, --seed, --backend)
    (tmp_path / "model.toml").write_text("[learner]\nsteps = 20\n[generator.backend]\ntype = 'sglang'\n")
    p = _plan(tmp_path, "--run-id", "g", "--config", str(tmp_path / "model.toml"), "--steps", "3", "--backend", "torch")
    assert p["learner"]["steps"] == 3 and p["generator"]["backend"] == {"type": "torch"}


def test_another_backend_from_a_flag_drops_the_files_fields_of_the_old_one(tmp_path):
    """examples/smollm2-cpu/relay.toml sets a torch backend with `threads`; `--backend vllm` over it used to
    fail on `backend.vllm.threads: unknown field`. The same type keeps the file's fields, --set adds to either."""
    (tmp_path / "t.toml").write_text("[generator.backend]\ntype = 'torch'\nthreads = 1\n")
    p = _plan(
        tmp_path,
        "--run-id",
        "a",
        "--config",
        str(tmp_path / "t.toml"),
        "--backend",
        "vllm",
        "--set",
        "generator.backend.cpu_kv_cache_gib=2",
    )
    assert p["generator"]["backend"] == {"type": "vllm", "cpu_kv_cache_gib": 2}
    p = _plan(tmp_path, "--run-id", "b", "--config", str(tmp_path / "t.toml"), "--backend", "torch")
    assert p["generator"]["backend"] == {"type": "torch", "threads": 1}


def test_environment_forms_of_the_launchers_flags(tmp_path):
    p = _plan(tmp_path, environ={"RELAY_RUN_ID": "from-env", "RELAY_TASK": "reverse"})
    assert p["run_id"] == "from-env" and p["learner"]["run_id"] == "from-env"
    assert p["broker"]["task"]["name"] == "reverse"
    p = _plan(tmp_path, "--run-id", "flag", "--task", "add", environ={"RELAY_RUN_ID": "x", "RELAY_TASK": "reverse"})
    assert p["run_id"] == "flag" and p["broker"]["task"]["name"] == "add"


@pytest.mark.parametrize("var", ["RELAY_STEPPS", "RELAY_SAMPLING__TEMPRATURE", "RELAY_LEARNER__STEPS"])
def test_an_unknown_relay_variable_is_refused_by_name(tmp_path, var):
    with pytest.raises(ConfigError) as e:
        _plan(tmp_path, "--run-id", "u", environ={var: "3", "RELAY_STEPS": "4"})
    msg = str(e.value)
    assert var in msg and "RELAY_STEPS" not in msg.replace(var, "") and "docs/config.md" in msg and "\n" not in msg


def test_a_bad_value_from_the_environment_names_the_field(tmp_path):
    with pytest.raises(ConfigError) as e:
        _plan(tmp_path, "--run-id", "v", environ={"RELAY_SAMPLING__TEMPERATURE": "-1"})
    assert "sampling.temperature" in str(e.value)


def test_services_started_by_relay_up_see_no_config_variable():
    env = {"RELAY_STEPS": "4", "RELAY_ARGS": "--steps 3", "RELAY_SMOLLM2": "/m", "PATH": "/bin"}
    assert environment.without_config_vars(env) == {"RELAY_ARGS": "--steps 3", "RELAY_SMOLLM2": "/m", "PATH": "/bin"}


def test_every_relay_variable_the_project_uses_is_config_a_flag_or_listed_as_not_config():
    """A RELAY_* name anywhere in the tree (Makefile, Compose, docs, tests) is either a field of some
    service, the environment form of a `relay up` flag, or in NOT_CONFIG: none is refused by mistake."""
    from broker.config import BrokerConfig
    from generators.config import GeneratorConfig
    from learner.config import LearnerConfig
    from reward_service.config import RewardConfig

    models = {"broker": BrokerConfig, "reward": RewardConfig, "generator": GeneratorConfig, "learner": LearnerConfig}
    text = subprocess.run(
        ["git", "grep", "-ohE", r"RELAY_[A-Z0-9_]+"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    names = set(text.split()) - {
        "RELAY_UNRELATED",
        "RELAY_STEPPS",
        "RELAY_SAMPLING__TEMPRATURE",
        "RELAY_LEARNER__STEPS",
        "RELAY_",
    }  # the misspellings tests use on purpose
    refused = []
    for name in sorted(names):
        try:
            environment.resolve(models, {name: "1"})
        except ConfigError:
            refused.append(name)
    assert not refused and len(names) > 20
    assert all(re.fullmatch(r"RELAY_[A-Z0-9_]+", n) for n in environment.NOT_CONFIG)


def test_secrets_stay_out_of_the_run_config_files_and_reach_the_service_by_its_environment():
    public, env = environment.split_secrets({"port": 1, "auth_token": "t0k"})
    assert public == {"port": 1} and env == {"RELAY_AUTH_TOKEN": '"t0k"'}
    cfg = {"backend": {"type": "sglang", "api_key": "k"}, "reward_token": "t0k", "seed": 1}
    public, env = environment.split_secrets(cfg)
    assert public == {"backend": {"type": "sglang"}, "seed": 1}
    assert env == {"RELAY_BACKEND__API_KEY": '"k"', "RELAY_REWARD_TOKEN": '"t0k"'}
    assert cfg["reward_token"] == "t0k"  # the plan itself is left as it was
    assert environment.split_secrets({"auth_token": ""}) == ({"auth_token": ""}, {})
    # the service reads the variable back as the same string, digits included
    from broker.runtime.config import load_config
    from reward_service.config import RewardConfig

    _, env = environment.split_secrets({"auth_token": "12345"})
    assert load_config(RewardConfig, None, environ=env).auth_token == "12345"


def test_the_ingest_is_authenticated_with_the_run_s_keys_unless_the_broker_says_insecure(tmp_path):
    p = _plan(tmp_path, "--run-id", "a")
    keydir = tmp_path / "a" / "secrets" / "ingest"
    assert p["broker"].get("ingest_auth", "curve") == "curve" == p["generator"]["ingest_auth"]
    assert p["broker"]["ingest_key_file"] == str(keydir / "broker.key_secret")
    assert p["broker"]["ingest_clients_file"] == str(keydir / "clients.json")
    assert p["generator"]["broker_public_key_file"] == str(keydir / "broker.key")
    # turned off on the broker: its generators follow (a mismatch would leave them unheard)
    off = _plan(tmp_path, "--run-id", "b", "--set", "broker.ingest_auth=insecure")
    assert off["broker"]["ingest_auth"] == "insecure" == off["generator"]["ingest_auth"]


def test_the_run_wide_weights_section_reaches_the_learner_and_the_generators(tmp_path):
    """``--set weights.transport=http`` (or ``[weights]`` in the file) configures both ends of the weight
    transfer; a service's own ``weights`` fields win over the run-wide ones."""
    (tmp_path / "run.toml").write_text('[weights.transport]\ntype = "collective"\nbucket_mb = 8\n')
    p = _plan(tmp_path, "--run-id", "a", "--set", "weights.transport=http")
    key = {"key_file": str(tmp_path / "a" / "secrets" / "weights.key")}  # the run's weights key: both read weights
    port = p["learner"]["weights"]["transport"]["port"]  # fixed: the generators fetch from that server only
    assert port > 0
    http = {"type": "http", "port": port}
    assert p["learner"]["weights"] == p["generator"]["weights"] == {"transport": http, **key}
    p = _plan(
        tmp_path,
        "--run-id",
        "b",
        "--config",
        str(tmp_path / "run.toml"),
        "--set",
        "generator.weights.transport.timeout_s=5",
    )
    key = {"key_file": str(tmp_path / "b" / "secrets" / "weights.key")}
    assert p["learner"]["weights"] == {"transport": {"type": "collective", "bucket_mb": 8}, **key}
    assert p["generator"]["weights"] == {"transport": {"type": "collective", "bucket_mb": 8, "timeout_s": 5}, **key}
    with pytest.raises(ConfigError, match="weights.transport"):
        _plan(tmp_path, "--run-id", "c", "--set", "weights.transport=ftp")


def test_a_layer_naming_another_transport_replaces_the_one_below(tmp_path):
    """A file's ``[weights.transport] type = "http"`` with its fields, then ``--set weights.transport=store``:
    the http fields do not carry over to the store (which has none); the same type merges."""
    (tmp_path / "run.toml").write_text('[weights.transport]\ntype = "http"\ncache_dir = "/tmp/c"\nport = 8213\n')
    cfg = ("--config", str(tmp_path / "run.toml"))
    p = _plan(tmp_path, "--run-id", "a", *cfg, "--set", "weights.transport=store")
    assert p["learner"]["weights"]["transport"] == {"type": "store"} == p["generator"]["weights"]["transport"]
    assert p["learner_config"].weights.transport.type == "store"
    p = _plan(
        tmp_path, "--run-id", "b", *cfg, "--set", "weights.transport=http", "--set", "weights.transport.linger_s=1"
    )
    assert p["generator"]["weights"]["transport"] == {
        "type": "http",
        "cache_dir": "/tmp/c",
        "port": 8213,
        "linger_s": 1,
    }


def test_under_the_http_transport_the_generators_get_no_weight_store(tmp_path):
    """No shared folder: the generators fetch from the learner's weight server, so `relay up` gives them no
    weight store path (with `store` they get the learner's, to refuse versions outside it)."""
    p = _plan(tmp_path, "--run-id", "a", "--set", "weights.transport=http")
    assert p["generator"]["weight_store"] == "" and p["learner"]["weight_store"].endswith("weights")
    p = _plan(tmp_path, "--run-id", "b")
    assert p["generator"]["weight_store"] == p["learner"]["weight_store"] != ""


def test_each_run_gets_its_own_reward_token_for_the_service_and_its_generators(tmp_path):
    a, b = _plan(tmp_path, "--run-id", "ta"), _plan(tmp_path, "--run-id", "tb")
    token = a["reward"]["auth_token"]
    assert len(token) >= 43 and token != b["reward"]["auth_token"]  # 32 random bytes, one per run
    assert a["generator"]["reward_token"] == token
    # it reaches both through their environment, never a config file
    assert environment.split_secrets(a["reward"])[1]["RELAY_AUTH_TOKEN"] == f'"{token}"'
    assert environment.split_secrets(a["generator"])[1]["RELAY_REWARD_TOKEN"] == f'"{token}"'
    assert token not in str(environment.split_secrets(a["reward"])[0])
    # the operator's own token wins, and "" turns the check off (loopback only)
    mine = _plan(tmp_path, "--run-id", "tc", environ={"RELAY_AUTH_TOKEN": "mine"})
    assert mine["reward"]["auth_token"] == "mine" == mine["generator"]["reward_token"]
    off = _plan(tmp_path, "--run-id", "td", "--set", "reward.auth_token=")
    assert off["reward"]["auth_token"] == "" and not off["generator"].get("reward_token")
    with pytest.raises(ConfigError, match="auth_token"):  # and then it may not leave loopback
        _plan(tmp_path, "--run-id", "te", "--set", "reward.auth_token=", "--set", "reward.host=0.0.0.0")


def test_a_resumed_run_keeps_its_reward_token(tmp_path):
    from deploy.launcher.run_tokens import keep_reward_token, recorded_reward_token, reward_token_path

    keep_reward_token(tmp_path / "r", "s3cret")
    assert recorded_reward_token(tmp_path / "r") == "s3cret" and recorded_reward_token(tmp_path / "none") == ""
    assert oct(reward_token_path(tmp_path / "r").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "r" / "secrets").stat().st_mode & 0o777) == "0o700"


def test_the_ports_relay_up_chooses_are_held_from_the_plan_on_and_moved_when_another_process_has_them(
    tmp_path, monkeypatch
):
    """Another run picked the same ports at the same moment (free_port answers a port another process
    holds): each port relay up chose moves to a free one, held by relay up from then on, with the
    generators' addresses following; a port the user set that is taken is an error naming the setting."""
    from deploy.launcher import procs
    from deploy.launcher.plan import UsageError

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, time\ns = socket.create_server(('127.0.0.1', 0))\n"
            "print(s.getsockname()[1], flush=True)\ntime.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        theirs = int(holder.stdout.readline())
        monkeypatch.setattr(procs, "free_port", lambda *a, **k: theirs)
        p = _plan(tmp_path, "--run-id", "a", "--set", "broker.ingest_workers=2")
        ingest = int(p["broker"]["ingest_bind"].rsplit(":", 1)[1])
        ours = [p["broker"]["http_port"], ingest, ingest + 1, p["reward"]["port"]]
        assert theirs not in ours and len(set(ours)) == 4, ours
        assert p["http_port"] == p["broker"]["http_port"]
        assert p["generator"]["broker_address"] == f"tcp://127.0.0.1:{ingest},tcp://127.0.0.1:{ingest + 1}"
        assert p["generator"]["reward"]["url"] == f"http://127.0.0.1:{p['reward']['port']}"
        held = p["listeners"]
        assert sorted(s.getsockname()[1] for socks in held.sockets.values() for s in socks) == sorted(ours)
        assert all(procs.port_in_use(port) for port in ours)  # bound until the run ends: nobody can take them
        assert held.env("broker") == {"RELAY_LISTEN_FDS": ",".join(map(str, held.fds("broker")))}
        held.close()
        monkeypatch.undo()
        with pytest.raises(
            UsageError, match=f"cannot listen on 127.0.0.1:{theirs} \\(reward.port\\): Address already in use"
        ):
            _plan(tmp_path, "--run-id", "b", "--set", f"reward.port={theirs}")
    finally:
        holder.kill()
        holder.wait()


def test_the_learner_is_told_the_generation_budget_and_the_longest_prompt(tmp_path):
    """seq-mean-token-sum-norm divides by the generators' budget (learner.loss_scale_tokens = 0), which relay up
    gives the learner with the longest prompt: the dataset's max_prompt_tokens, or the built-in task's."""
    p = _plan(
        tmp_path,
        "--run-id",
        "a",
        "--set",
        "learner.aggregation=seq-mean-token-sum-norm",
        "--set",
        "generator.sampling.max_tokens=12",
    )
    assert p["learner_config"].loss_scale == p["learner_config"].batch.max_completion_tokens == 12
    assert 3 <= p["learner_config"].batch.max_prompt_tokens <= 64  # the copy task's short prompts
    mine = _plan(tmp_path, "--run-id", "b", "--set", "learner.loss_scale_tokens=100")
    assert mine["learner_config"].loss_scale == 100


def test_relay_up_refuses_a_generation_budget_no_micro_batch_can_hold(tmp_path):
    # the tiny model's context is 64 positions: a budget of 40 fits it, with the copy task's prompts not 32 tokens
    with pytest.raises(ConfigError, match="raise learner.compute.micro_batch_tokens to"):
        _plan(
            tmp_path,
            "--run-id",
            "a",
            "--set",
            "generator.sampling.max_tokens=40",
            "--set",
            "learner.compute.micro_batch_tokens=32",
        )
    ok = _plan(tmp_path, "--run-id", "b", "--set", "generator.sampling.max_tokens=40")
    assert ok["learner_config"].batch.max_completion_tokens == 40


def test_a_budget_past_the_model_s_context_and_the_micro_batch_names_the_context_first(tmp_path):
    """The model's context is the more fundamental limit: raising micro_batch_tokens, as the learner's error
    would say, could never make a budget of 9000 work on a model of 64 positions."""
    with pytest.raises(PreflightError, match="generator.sampling.max_tokens = 9000 does not fit .* context of 64"):
        _plan(tmp_path, "--run-id", "a", "--set", "generator.sampling.max_tokens=9000")
