"""The end-of-run report, `relay status RUN` on a finished run, and what `relay up --resume` refuses or
moves, on run folders written here (no service started)."""

import argparse
import json
import socket
import subprocess
import sys
import time

import pytest

from deploy.launcher.report import format_report
from deploy.launcher.plan import UsageError, plan
from deploy.launcher.start import generator_configs
from deploy.launcher.up import add_up_arguments
from tests.support.services import relay

SUMMARY = {
    "status": "completed",
    "error": None,
    "run_id": "r1",
    "steps": 600,
    "steps_total": 600,
    "versions_published": 600,
    "reward_first": 0.052,
    "reward_last": 0.934,
    "groups_trained": 19200,
    "groups_dropped_stale": 3,
    "groups_rejected": 0,
    "generators": {},
    "wall_seconds": 212.4,
    "resumes": 0,
    "audit": {"produced": 19210, "trained_once": 19200, "trained_twice": 0, "dropped": 3, "queued": 7, "lost": 0},
    "eval": [
        {"version": 0, "round": 0, "pass@1": 0.0},
        {"version": 300, "round": 300, "pass@1": 0.5},
        {"version": 590, "round": 590, "pass@1": 0.95},
    ],
    "export": {"path": "/x/runs/r1/export", "version": 600, "manifest_hash": "ab"},
    "restarts": {"broker": 0, "learner": 1},
}


def test_the_report_says_how_the_run_went_in_a_few_lines(tmp_path):
    text = format_report(SUMMARY, tmp_path / "r1")
    lines = text.splitlines()
    assert lines[0] == "relay up: run r1 completed: 600/600 steps in 3m32s"
    assert "reward       0.052 -> 0.934" in text
    assert "eval pass@1  0.000 (v0) -> 0.950 (v590)   3 rounds" in text
    assert "19200 trained, 3 dropped stale, 0 rejected; audit: lost 0, trained twice 0" in text
    assert "restarts     learner 1" in text and "broker" not in text
    assert "/x/runs/r1/export (version 600" in text
    assert str(tmp_path / "r1" / "summary.json") in text and str(tmp_path / "r1" / "logs") in text
    assert len(lines) <= 10 and "{" not in text  # not the JSON dump

    failed = format_report(
        {**SUMMARY, "status": "failed", "error": "learner (pid 7) exited with code 1", "export": None, "eval": []},
        tmp_path / "r1",
    )
    assert failed.splitlines()[-1] == "  error        learner (pid 7) exited with code 1"  # last, where it is seen
    assert "export" not in failed and "eval" not in failed


def test_the_report_says_what_failed_on_the_way(tmp_path):
    """Reward failures by plugin with their reason, groups dropped for them, restarts with their last error,
    and the warnings printed during the run: once only in summary.json ("0 dropped stale" and nothing more)."""
    text = format_report(
        {
            **SUMMARY,
            "groups_trained": 0,
            "groups_dropped_stale": 0,
            "groups_dropped": {"reward_failed": 26240},
            "reward_failures": {
                "samples": 210048,
                "samples_scored": 0,
                "by_plugin": {"mine": 210048},
                "last_reason": {"mine": "plugin_error: ValueError: boom"},
                "groups_dropped": 26240,
                "samples_trained_on_fallback": 0,
            },
            "restarts": {"gen-0": 2},
            "restart_errors": {"gen-0": "ValueError: no tools"},
            "warnings": ["the policy has collapsed: ..."],
        },
        tmp_path / "r1",
    )
    assert "0 trained, 0 dropped stale, 26240 dropped (every reward failed), 0 rejected" in text
    assert "  rewards      210048 of 210048 samples failed: mine 210048 (plugin_error: ValueError: boom)" in text
    assert "  restarts     gen-0 2 (last error: ValueError: no tools)" in text
    assert "  warning      the policy has collapsed: ..." in text


def test_relay_status_shows_a_finished_run_from_its_folder(tmp_path):
    run = tmp_path / "runs" / "r1"
    (run / "config").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    res = relay("status", "r1", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 0 and res.stdout.startswith("relay up: run r1 completed: 600/600 steps"), res
    res = relay("status", str(run), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["reward_last"] == 0.934
    (run / "summary.json").write_text(json.dumps({**SUMMARY, "status": "failed", "error": "boom"}))
    res = relay("status", str(run))
    assert res.returncode == 1 and res.stdout.rstrip().endswith("error        boom")
    # no summary and nothing running: killed mid-run, and it says how to continue
    (run / "summary.json").unlink()
    res = relay("status", str(run))
    assert res.returncode == 1 and f"-m deploy.cli up --resume {run}" in res.stderr, res.stderr  # as it was run
    res = relay("status", "nope", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 1 and "not a run folder" in res.stderr


def test_plain_relay_status_shows_the_latest_run_not_port_8080(tmp_path):
    """`relay status` with no RUN, --url or --redis-url is `relay status latest`: the last run started in
    the runs folder (before, it asked http://127.0.0.1:8080, whatever ran there or nothing)."""
    runs = tmp_path / "runs"
    (runs / "r1" / "config").mkdir(parents=True)
    (runs / "r1" / "summary.json").write_text(json.dumps(SUMMARY))
    (runs / "latest").symlink_to("r1")
    res = relay("status", cwd=tmp_path)  # the default --runs-dir, runs, from where relay up was run
    assert res.returncode == 0 and res.stdout.startswith("relay up: run r1 completed: 600/600 steps"), res
    res = relay("status", "--runs-dir", str(runs), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["run_id"] == "r1", res
    # --url still reads that broker, and without a latest run plain status asks the default address
    res = relay("status", "--url", "http://127.0.0.1:1", cwd=tmp_path)
    assert res.returncode == 1 and "http://127.0.0.1:1/api/state" in res.stderr, res
    res = relay("status", "--runs-dir", str(tmp_path / "none"), "--url", "http://127.0.0.1:1")
    assert res.returncode == 1 and "give a RUN folder" in res.stderr, res


def test_relay_status_shows_a_resumed_run_that_is_running_live_not_its_old_summary(tmp_path):
    run = tmp_path / "runs" / "r1"
    (run / "config").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({**SUMMARY, "status": "interrupted"}))  # the part before
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (run / "config" / "broker.json").write_text(json.dumps({"http_port": port}))
    # the run's broker, as far as relay status sees it: a process of the run (pids.json, the run folder
    # in its command line) serving /api/state on the recorded port
    state = {"run_id": "r1", "learner_version": 7, "learner": {"step": 9}, "generators": []}
    server = (
        "import http.server, json, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(sys.argv[2].encode())\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", server, str(port), json.dumps(state), str(run)])
    _until_exec(proc.pid, run)
    try:
        (run / "pids.json").write_text(json.dumps({"broker": proc.pid}))
        deadline = time.monotonic() + 10
        while socket.socket().connect_ex(("127.0.0.1", port)) and time.monotonic() < deadline:
            time.sleep(0.05)
        res = relay("status", str(run))
        assert res.returncode == 0 and "learner version 7" in res.stdout and "step 9" in res.stdout, res
        assert "interrupted" not in res.stdout
    finally:
        proc.kill()
        proc.wait()
    res = relay("status", str(run))  # stopped again: the summary
    assert res.returncode == 0 and "run r1 interrupted" in res.stdout


def _run_folder(tmp_path, summary: dict | None, aof: str = "everysec"):
    """A run folder as `relay up` leaves it (configs, launch.json, Redis's AOF folder)."""
    run = tmp_path / "runs" / "r1"
    (run / "config").mkdir(parents=True)
    (run / "appendonlydir").mkdir()
    redis = "redis://127.0.0.1:6390/0"
    cfgs = {
        "broker": {"run_id": "r1", "redis_url": redis, "ingest_bind": "tcp://127.0.0.1:6391", "http_port": 6392},
        "reward": {"port": 6393},
        "learner": {"run_id": "r1", "redis_url": redis, "steps": 50, "run_dir": str(run / "learner")},
        "generator-0": {
            "id": "gen-0",
            "run_id": "r1",
            "redis_url": redis,
            "broker_address": "tcp://127.0.0.1:6391",
            "reward_url": "http://127.0.0.1:6393",
        },
    }
    for name, c in cfgs.items():
        (run / "config" / f"{name}.json").write_text(json.dumps(c))
    (run / "launch.json").write_text(
        json.dumps({"generators": 3, "learner_ranks": 1, "embedded_redis": True, "redis_aof": aof})
    )
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def _plan(tmp_path, *argv, environ=None):
    p = argparse.ArgumentParser()
    add_up_arguments(p)
    args = p.parse_args(["--runs-dir", str(tmp_path / "runs"), *argv])
    return plan(args, environ=environ or {}), args


def test_resume_keeps_the_recorded_config_and_moves_only_ports_that_are_taken(tmp_path):
    run = _run_folder(tmp_path, {"status": "interrupted", "steps": 20, "wall_seconds": 30.0})
    with socket.socket() as busy:  # the recorded ingest port is taken now
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 6391))
        busy.listen()
        p, args = _plan(tmp_path, "--resume", "r1")
    assert p["run_dir"] == run.resolve() and p["run_id"] == "r1" and args.generators == 3
    assert p["learner"]["steps"] == 50 and p["resumed"]["steps"] == 20
    assert p["broker"]["ingest_bind"] != "tcp://127.0.0.1:6391"
    assert p["generator"]["broker_address"] == p["broker"]["ingest_bind"]  # the generators follow it
    assert p["generator"]["reward"]["url"] == f"http://127.0.0.1:{p['reward']['port']}"
    assert p["broker"]["redis_url"] == p["learner"]["redis_url"] == p["generator"]["redis_url"] == p["redis_url"]
    assert "redis_url" not in p["reward"] and "id" not in p["generator"]
    # tokens are never in the run folder: they come from the environment again
    p, _ = _plan(tmp_path, "--resume", str(run), environ={"RELAY_AUTH_TOKEN": '"t0k"'})
    assert p["reward"]["auth_token"] == "t0k" and p["generator"]["reward_token"] == "t0k"


def test_resume_gives_every_generator_its_own_ingest_key_again(tmp_path):
    """generator-0.json is the run's generator section as resume reads it back, but its ingest key is
    generator 0's alone: after a resume every generator must have its own again, or the broker refuses
    every group of the others (their key is bound to gen-0's id)."""
    run = _run_folder(tmp_path, {"status": "interrupted", "steps": 20})
    keys = run.resolve() / "secrets" / "ingest"
    gen0 = json.loads((run / "config" / "generator-0.json").read_text())
    gen0["ingest_key_file"] = str(keys / "generator-gen-0.key_secret")
    (run / "config" / "generator-0.json").write_text(json.dumps(gen0))
    p, args = _plan(tmp_path, "--resume", "r1")
    own = {f"gen-{i}": str(keys / f"generator-gen-{i}.key_secret") for i in range(args.generators)}
    cfgs = generator_configs(p["generator"], own, args.generators)
    assert [c["id"] for c in cfgs] == ["gen-0", "gen-1", "gen-2"]
    assert [c["ingest_key_file"] for c in cfgs] == [own["gen-0"], own["gen-1"], own["gen-2"]]
    # a key the user named for every generator (not one of the run's own) is kept for all of them
    gen0["ingest_key_file"] = str(tmp_path / "shared.key_secret")
    (run / "config" / "generator-0.json").write_text(json.dumps(gen0))
    p, _ = _plan(tmp_path, "--resume", "r1")
    assert {c["ingest_key_file"] for c in generator_configs(p["generator"], own, 3)} == {
        str(tmp_path / "shared.key_secret")
    }


@pytest.mark.parametrize(
    "summary,aof,argv,environ,message",
    [
        ({"status": "completed", "steps": 50}, "everysec", [], {}, "completed (50 of 50 steps): nothing to resume"),
        ({"status": "interrupted"}, "off", [], {}, "kept no Redis data (--redis-aof off)"),
        (
            {"status": "interrupted"},
            "everysec",
            ["--steps", "80", "--set", "learner.optim.lr=0.1"],
            {},
            "recorded config (config/*.json); leave out --steps, --set",
        ),
        ({"status": "interrupted"}, "everysec", [], {"RELAY_STEPS": "80"}, "unset RELAY_STEPS"),
        (None, "everysec", ["--generators", "1"], {}, "leave out --generators"),
    ],
)
def test_resume_refuses_what_would_not_continue_the_run_as_recorded(tmp_path, summary, aof, argv, environ, message):
    _run_folder(tmp_path, summary, aof)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        _plan(tmp_path, "--resume", "r1", *argv, environ=environ)


def test_resume_of_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(UsageError, match="not a run folder"):
        _plan(tmp_path, "--resume", "nope")


def test_resume_of_a_run_that_is_still_running_is_refused(tmp_path):
    run = _run_folder(tmp_path, None)
    # a process of the run, as pids.json records it (its command line names the run folder)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", str(run)])
    _until_exec(proc.pid, run)
    try:
        (run / "pids.json").write_text(json.dumps({"redis": proc.pid}))
        with pytest.raises(UsageError, match=f"still running \\(redis pid {proc.pid}\\)"):
            _plan(tmp_path, "--resume", "r1")
    finally:
        proc.kill()
        proc.wait()
    _plan(tmp_path, "--resume", "r1")  # once it is gone, the run resumes


def _until_exec(pid: int, run) -> None:
    """Until the child runs its own command (between fork and exec it still shows pytest's)."""
    deadline = time.monotonic() + 10
    while str(run).encode() not in open(f"/proc/{pid}/cmdline", "rb").read():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_resume_of_a_run_from_before_ed25519_is_refused_saying_how_to_continue(tmp_path):
    """Its announce.key is the HMAC key every generator held: its announcements cannot be trusted as the
    learner's, so the run is not continued; the message says how to carry its weights into a new run."""
    run = _run_folder(tmp_path, {"status": "interrupted", "steps": 20})
    (run / "secrets").mkdir(mode=0o700)
    (run / "secrets" / "announce.key").write_text("ab" * 32 + "\n")
    with pytest.raises(UsageError, match="before weight announcements were signed with Ed25519") as e:
        _plan(tmp_path, "--resume", "r1")
    assert f"relay export {run.resolve()} --out r1-model" in str(e.value) and "relay up --model r1-model" in str(
        e.value
    )


def test_resume_gives_each_service_its_half_of_the_keys_and_moves_a_taken_weight_server_port(tmp_path):
    """A run recorded before the transport became a section chosen by its type (``weights.transport = "http"``
    and ``[weights.http]``) resumes, its old section read as ``weights.transport``."""
    run = _run_folder(tmp_path, {"status": "interrupted", "steps": 20})
    for name in ("learner", "generator-0"):
        path = run / "config" / f"{name}.json"
        path.write_text(
            json.dumps({**json.loads(path.read_text()), "weights": {"transport": "http", "http": {"port": 6394}}})
        )
    with socket.socket() as busy:  # the learner's weight server port, taken now
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 6394))
        busy.listen()
        p, _ = _plan(tmp_path, "--resume", "r1")
    secrets = run.resolve() / "secrets"
    assert p["learner"]["announce_key_file"] == str(secrets / "announce.key")
    assert "announce_key_file" not in p["broker"] and "announce_key_file" not in p["generator"]
    assert (
        p["broker"]["announce_public_key_file"]
        == p["generator"]["announce_public_key_file"]
        == str(secrets / "announce.pub")
    )
    port = p["learner"]["weights"]["transport"]["port"]
    assert port != 6394 and p["generator"]["weights"]["transport"] == {"type": "http", "port": port}  # they follow it
    assert p["learner"]["weights"]["key_file"] == p["generator"]["weights"]["key_file"] == str(secrets / "weights.key")


def test_resume_of_a_run_recorded_before_the_generation_budget_gives_its_learner_the_budget(tmp_path):
    """A run recorded before the learner was told the generation budget (learner.batch.max_completion_tokens):
    with seq-mean-token-sum-norm its learner would refuse to start without T. --resume takes the budget from
    the run's recorded generator config, as relay up does, and hands it to the learner; it does not refuse the
    run for a sequence past micro_batch_tokens, a check the run started without (the prompts stay unknown)."""
    run = _run_folder(tmp_path, {"status": "interrupted", "steps": 20})
    for name, extra in (
        ("learner", {"aggregation": "seq-mean-token-sum-norm", "compute": {"micro_batch_tokens": 64}}),
        ("generator-0", {"sampling": {"max_tokens": 100}}),
    ):
        path = run / "config" / f"{name}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    p, _ = _plan(tmp_path, "--resume", "r1")
    assert p["learner_config"].loss_scale == 100  # T: the recorded generators' sampling.max_tokens
    assert p["learner"]["batch"] == {"max_completion_tokens": 100}  # what the resumed learner's config file gets
    # with an environment the budget is the episode's, as relay up gives it
    path = run / "config" / "generator-0.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "episodes": {"env": "calc", "max_tokens": 80}}))
    assert _plan(tmp_path, "--resume", "r1")[0]["learner_config"].loss_scale == 80
