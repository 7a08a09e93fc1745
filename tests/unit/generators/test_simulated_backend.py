"""The simulated backend (the stand-in engine of `relay bench overlap`): valid completions that the
wire protocol accepts, at the configured speed."""

import time

import numpy as np

from broker.protocol.group import Group, Sample, decode_group, encode_group
from generators.config import GeneratorConfig, SamplingConfig
from learner.tiny_model import build_tiny_model


def test_simulated_backend_sleeps_per_token_and_returns_valid_completions(tmp_path):
    build_tiny_model(tmp_path / "m")
    cfg = GeneratorConfig.model_validate(
        {"backend": {"type": "simulated", "per_token_latency_s": 0.002, "eos_prob": 0.2}}
    )
    b = cfg.backend.build()
    b.load(str(tmp_path / "m"))
    prompt = b.encode("473=")
    assert prompt == [1, 7, 10, 6, 14]
    sampling = SamplingConfig(n=4, max_tokens=6)
    t0 = time.perf_counter()
    groups = b.generate([prompt, prompt], sampling, seed=3)
    elapsed = time.perf_counter() - t0
    assert [len(g) for g in groups] == [4, 4]
    ntok = sum(len(c.token_ids) for g in groups for c in g)
    assert elapsed >= 0.002 * ntok * 0.95  # it sleeps for every generated token
    for c in (c for g in groups for c in g):
        assert 1 <= len(c.token_ids) == len(c.logprobs) <= 6
        assert all(3 <= t < 15 for t in c.token_ids[:-1]) and all(lp <= 0 for lp in c.logprobs)
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == b.eos_token_id)
    # what it produces passes the broker's validation
    s = [
        Sample(
            np.array(c.token_ids, np.int32),
            np.array(c.logprobs, np.float32),
            [[0, len(c.token_ids)]],
            c.finish_reason,
            0.0,
        )
        for c in groups[0]
    ]
    g = Group(Group.new_id(), "r", "p", np.array(prompt, np.int32), s, "gen", 0, "0" * 64, sampling.model_dump())
    assert len(decode_group(encode_group(g)).samples) == 4
    assert groups == b.generate([prompt, prompt], sampling, seed=3)  # seeded
