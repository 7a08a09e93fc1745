"""A learner's publication path on its own, for a test that kills it: the tiny model's config and
tokenizer, a state of ~16 MB that changes each version, handed to a real BackgroundPublisher (real
Redis, real weight store, signed announcements) as fast as it takes them.

    python -m tests.support.publish_loop REDIS_URL STORE KEY_FILE MODEL_DIR
"""

from __future__ import annotations

import sys


def main(redis_url: str, store: str, key_file: str, model_dir: str) -> None:
    import redis
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from broker.protocol.keys import Keys
    from broker.protocol.signing import read_signer
    from learner.publish import BackgroundPublisher, Publisher, first_version, snapshot
    from learner.tiny_model import build_tiny_model

    build_tiny_model(model_dir)
    r = redis.Redis.from_url(redis_url)
    pub = Publisher(
        r,
        Keys("kill"),
        store,
        AutoTokenizer.from_pretrained(model_dir),
        keep_versions=1000,
        announce_key=read_signer(key_file),
        dtype=torch.bfloat16,
        shard_mb=3.0,
    )
    bg = BackgroundPublisher(pub, AutoConfig.from_pretrained(model_dir))
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(8)}
    version = first_version(None, store)
    while True:
        for t in state.values():
            t.add_(1.0)
        bg.submit(version, snapshot(state, version, torch.bfloat16))
        version += 1


if __name__ == "__main__":
    main(*sys.argv[1:5])
