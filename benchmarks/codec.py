"""codec: encode + decode (with full validation) of one group message, against a raw copy of the same
arrays with ``numpy.tobytes`` / ``numpy.frombuffer``.

A group of 8 samples × 1,024 tokens: per sample the token ids (int32), the behaviour log-probs
(float32) and the per-token versions (the wire sends them run-length encoded; the raw copy sends
them as an int32 array). MB/s counts the same bytes for both: the arrays' raw size.
"""

from __future__ import annotations

import numpy as np

from benchmarks.common import median_time, row
from broker.protocol.group import Group, Sample, decode_group, encode_group, runs_to_versions, versions_to_runs

TARGET = 3.0  # issue 21: encode + decode within 3x a raw copy of the same arrays


def make_group(samples: int, tokens: int, seed: int = 0, run_id: str = "bench") -> Group:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(samples):
        versions = np.sort(rng.integers(10, 12, tokens))  # a weight update in the middle of the completion
        out.append(
            Sample(
                completion_ids=rng.integers(0, 150_000, tokens).astype(np.int32),
                logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
                version_runs=versions_to_runs(versions),
                finish_reason="length",
                reward=0.5,
            )
        )
    return Group(
        group_id=Group.new_id(),
        run_id=run_id,
        prompt_id="0-1",
        prompt_ids=rng.integers(0, 150_000, 128).astype(np.int32),
        samples=out,
        generator_id="gen-0",
        weight_version=10,
        weight_hash="0" * 64,
        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": tokens, "n": samples},
    )


def run(quick: bool) -> list[dict]:
    samples, tokens = 8, 1024
    g = make_group(samples, tokens)
    arrays = [(s.completion_ids, s.logprobs, runs_to_versions(s.version_runs).astype(np.int32)) for s in g.samples]
    nbytes = sum(a.nbytes for t in arrays for a in t)

    def codec() -> None:
        back = decode_group(encode_group(g))
        assert len(back.samples) == samples

    def raw() -> None:
        blobs = [(ids.tobytes(), lps.tobytes(), ver.tobytes()) for ids, lps, ver in arrays]
        back = [
            (np.frombuffer(a, np.int32), np.frombuffer(b, np.float32), np.frombuffer(c, np.int32)) for a, b, c in blobs
        ]
        assert len(back) == samples

    repeats, number = (3, 20) if quick else (15, 200)
    value, baseline = [], []
    for _ in range(repeats):  # interleaved, so both see the same machine load
        value.append(median_time(codec, 1, number))
        baseline.append(median_time(raw, 1, number))
    v, b = float(np.median(value)), float(np.median(baseline))
    enc = median_time(lambda: encode_group(g), 3, number)
    payload = encode_group(g)
    dec = median_time(lambda: decode_group(payload), 3, number)
    return [
        row(
            "codec",
            v * 1e6,
            b * 1e6,
            "µs per group",
            TARGET,
            "lower",
            {
                "samples": samples,
                "tokens_per_sample": tokens,
                "array_bytes": nbytes,
                "message_bytes": len(payload),
                "codec_MB_per_s": nbytes / v / 1e6,
                "raw_MB_per_s": nbytes / b / 1e6,
                "encode_us": enc * 1e6,
                "decode_us": dec * 1e6,
                "repeats": repeats,
                "calls_per_repeat": number,
            },
        )
    ]
