"""DeepSpeed's CPU communication op, when the process that was building it stopped and released its
build lock without a library (a learner whose run ended mid-build): torch's waiter then imports a
missing ``.so``. The learner builds it again instead of failing at start-up (learner/engine.py)."""

import subprocess
import sys
import time

import pytest

from tests.support.services import ROOT, child_env

pytestmark = pytest.mark.slow


def test_a_build_left_unfinished_by_another_process_is_built_again(tmp_path):
    op = tmp_path / "deepspeed_shm_comm"
    op.mkdir()
    (op / "lock").touch()  # another process is building it...
    proc = subprocess.Popen([sys.executable, "-c", "import logging; logging.basicConfig(); "
                             "from learner.engine import _shm_comm_op_built; _shm_comm_op_built(); print('loaded')"],
                            cwd=ROOT, env={**child_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(5)  # the learner waits on the lock
    (op / "lock").unlink()  # ...and stopped without a library
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.strip() == "loaded", err[-3000:]
    assert "stopped before it finished; building it again" in err
    assert (op / "deepspeed_shm_comm.so").is_file()
