"""A real learner (learner/trainer.py: real DeepSpeed on CPU, the tiny model, a real Redis) whose second
step gets NaN advantages, fed below the broker's and the intake's checks (the advantage estimator of
its update replaced for that step: the test hook), between two normal steps.

    python -m tests.support.learner_nonfinite REDIS_URL RUN_DIR

Writes RUN_DIR/out.json: the weights' sha256 before training and after each step (rank checksums),
the optimizer state's digest before and after the poisoned step, and the learner's /metrics text.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from pathlib import Path


def optimizer_digest(engine) -> str:
    import torch

    h = hashlib.sha256()
    for i, state in sorted(engine.optimizer.state_dict()["state"].items()):
        for k, v in sorted(state.items()):
            h.update(f"{i}.{k}".encode())
            h.update(v.detach().cpu().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


def main(redis_url: str, run_dir: Path) -> None:
    import httpx
    import redis
    import torch

    from benchmarks.learner import make_groups
    from broker.client import queues
    from broker.protocol.group import encode_group
    from broker.protocol.keys import Keys
    import learner.update as update_module
    from learner.config import LearnerConfig
    from learner.ranks import write_checksum
    from learner.trainer import Learner

    from broker.protocol.signing import write_key_pair

    key, _ = write_key_pair(
        Path(run_dir) / "announce.key", Path(run_dir) / "announce.pub"
    )  # the learner signs what it announces
    cfg = LearnerConfig(
        announce_key_file=str(key),
        run_id="bench",
        redis_url=redis_url,
        run_dir=str(run_dir),
        weight_store=str(run_dir / "weights"),
        steps=3,
        batch_groups=2,
        publish_every=1,
        checkpoint_every=0,
        tensorboard=False,
        rank_checksums=True,
        wait_timeout_s=60,
        admission_eta=None,
    )
    r, keys = redis.Redis.from_url(redis_url), Keys(cfg.run_id)
    queues.ensure_groups(r, keys)
    pipe = r.pipeline()
    queues.append_groups(pipe, keys, 100, 1 << 30, [(g, encode_group(g)) for g in make_groups(6, 4, 6, seed=3)])
    pipe.execute()

    learner = Learner(cfg)
    write_checksum(learner.engine.module, run_dir / "rank-0.checksums", 0)
    real, calls = update_module.batch_advantages, itertools.count()
    digests = {}

    def poisoned(estimator, rewards, tokens):
        """NaN advantages for the second step's batch (the hook), the real estimator otherwise."""
        n = next(calls)
        if n == 1:
            digests["optimizer_before"] = optimizer_digest(learner.engine)
        if n == 2:
            digests["optimizer_after_skip"] = optimizer_digest(learner.engine)
        out = real(estimator, rewards, tokens)
        return [torch.full_like(a, float("nan")) for a in out] if n == 1 else out

    update_module.batch_advantages = poisoned  # the learner computes each batch's advantages through it
    learner.run()
    metrics = httpx.get(f"http://127.0.0.1:{learner.log.observer.server.port}/metrics", timeout=10).text
    sums = [json.loads(x)["sha256"] for x in (run_dir / "rank-0.checksums").read_text().splitlines()]
    (run_dir / "out.json").write_text(json.dumps({"weights": sums, "metrics": metrics, **digests}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
