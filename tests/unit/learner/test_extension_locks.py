"""A lock file left in torch's extension folder by a learner killed while DeepSpeed loaded its op is
removed once it is older than any build takes (learner/engine.py); a fresh one (an op being built now)
is left alone."""

import os
import time

from learner.engine import stale_extension_locks_removed


def test_a_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    os.utime(stale, (time.time() - 600, time.time() - 600))
    with stale_extension_locks_removed(tmp_path, stale_s=300, every_s=0.05):
        deadline = time.time() + 10
        while stale.exists() and time.time() < deadline:
            time.sleep(0.05)
    assert not stale.exists() and fresh.exists()
    assert "deepspeed_shm_comm/lock" in caplog.text and "killed" in caplog.text
