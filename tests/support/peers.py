"""Generator processes for the in-process weight transports' tests (tests/support/collective_peer.py run as
a subprocess: the collective or, with ``--transport ipc``, shared memory), and the versions they get."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.support.services import ROOT, announce_public_key_file, child_env, weights_key_file


def start_peer(procs: list, redis_url: str, tmp_path, model, gid: str, run: str, *extra: str) -> subprocess.Popen:
    """A peer generator ``gid`` of run ``run`` (its log in ``tmp_path/<gid>.log``), added to ``procs``."""
    cmd = [
        sys.executable,
        str(ROOT / "tests/support/collective_peer.py"),
        "--redis",
        redis_url,
        "--run",
        run,
        "--key-file",
        str(announce_public_key_file(tmp_path)),
        "--weights-key-file",
        str(weights_key_file(tmp_path)),
        "--model",
        str(model),
        "--id",
        gid,
        *extra,
    ]
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=open(tmp_path / f"{gid}.log", "w"), env=child_env(), cwd=ROOT, text=True
    )
    procs.append(p)
    return p


def peer_result(p: subprocess.Popen, tmp_path, gid: str, timeout: float = 180) -> dict:
    """The JSON line a peer prints when it is done (what it serves, what it refused)."""
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, (tmp_path / f"{gid}.log").read_text()[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    # leaving the group ends the receiving thread at once (one left inside gloo can abort the process at exit)
    assert result["thread_ended"] and result["left_s"] < 3, result
    return result


def moved_version(model_dir, delta: float, device: str = "cpu", dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The tiny model's published tensors (lm_head tied: left out), each moved by ``delta``."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir)
    return {
        k: (v + delta).to(device=device, dtype=dtype).contiguous()
        for k, v in m.state_dict().items()
        if k != "lm_head.weight"
    }
