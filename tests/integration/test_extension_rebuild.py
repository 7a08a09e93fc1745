"""DeepSpeed's CPU communication op, when the learner that was loading or building it was SIGKILLed:
torch's lock file (``<op>/lock``) outlives it. The next learner waits only while a live Relay process
holds the op's lock, then removes the dead one's file and loads the op, built again (learner/engine.py,
``ops_lock``); it used to wait ``RELAY_STALE_EXTENSION_LOCK_S`` (3 minutes), and a CI test timed out."""

import subprocess
import sys
import time

import pytest

from tests.support.services import ROOT, child_env

pytestmark = pytest.mark.slow


def test_a_lock_left_by_a_killed_loader_is_removed_at_once_and_the_op_built(tmp_path):
    op = tmp_path / "deepspeed_shm_comm"
    op.mkdir()
    env = {**child_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path), "RELAY_STALE_EXTENSION_LOCK_S": "3600"}
    # a learner loading the op: it holds Relay's lock and has taken torch's, no library yet
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
            "fcntl.flock(f, fcntl.LOCK_EX); open(sys.argv[2], 'w'); print('held', flush=True); "
            "time.sleep(600)",
            str(tmp_path / "deepspeed_shm_comm.relay-lock"),
            str(op / "lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import logging; logging.basicConfig(); "
            "from learner.engine import _shm_comm_op_built; _shm_comm_op_built(); print('loaded')",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(5)
        # while its holder lives, the lock is respected: nothing removed, nothing loaded
        assert proc.poll() is None and (op / "lock").exists()
        holder.kill()  # the holder is SIGKILLed mid-build: torch's lock file stays behind
        holder.wait()
        out, err = proc.communicate(timeout=300)  # well under the 3600 s staleness limit set above
    finally:
        holder.kill()
        proc.kill()
    assert proc.returncode == 0 and out.strip() == "loaded", err[-3000:]
    assert "left by a process killed while it loaded or built that op" in err
    assert (op / "deepspeed_shm_comm.so").is_file() and not (op / "lock").exists()
