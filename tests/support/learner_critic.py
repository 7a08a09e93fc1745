"""A real learner (learner/trainer.py: real DeepSpeed on CPU, the tiny model, a real Redis) training
with ``gae`` and the critic on queued groups whose completions are of even tokens (reward 1) or of odd
tokens (reward 0): from the second completion token on, a value model that reads the current token can
explain the return.

    python -m tests.support.learner_critic REDIS_URL RUN_DIR STEPS

Writes the learner's RUN_DIR/metrics.jsonl.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np


def main(redis_url: str, run_dir: Path, steps: int) -> None:
    import redis

    from benchmarks.learner import make_groups
    from broker.client import queues
    from broker.protocol.group import encode_group
    from broker.protocol.keys import Keys
    from learner.config import LearnerConfig
    from learner.trainer import Learner

    from broker.protocol.signing import write_key_pair

    key, _ = write_key_pair(
        Path(run_dir) / "announce.key", Path(run_dir) / "announce.pub"
    )  # the learner signs what it announces
    cfg = LearnerConfig(
        announce_key_file=str(key),
        run_id="critic",
        redis_url=redis_url,
        run_dir=str(run_dir),
        weight_store=str(run_dir / "weights"),
        steps=steps,
        batch_groups=4,
        checkpoint_every=0,
        tensorboard=False,
        wait_timeout_s=60,
        admission_eta=None,
        max_staleness=10_000,
        advantage="gae",
        critic={"enabled": True, "lr": 2e-3},
    )  # the test's few steps: a faster critic
    groups = make_groups(4 * steps, 4, 6, seed=5)
    rng = np.random.default_rng(5)
    for g in groups:
        for i, s in enumerate(g.samples):
            parity = int(rng.integers(2))  # token ids 3..12 are the digits; 2 is EOS
            ids = rng.choice(np.arange(3 + parity, 13, 2), len(s.completion_ids) - 1)
            g.samples[i] = replace(s, completion_ids=np.append(ids, 2).astype(np.int32), reward=float(parity == 1))
    r, keys = redis.Redis.from_url(redis_url), Keys(cfg.run_id)
    queues.ensure_groups(r, keys)
    pipe = r.pipeline()
    queues.append_groups(pipe, keys, 10_000, 1 << 30, [(g, encode_group(g)) for g in groups])
    pipe.execute()
    Learner(cfg).run()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
