"""Micro-batches and ranks change nothing but memory: for every aggregation mode and policy loss
(plus the icepop and token_mis corrections with two minibatches, and gae and vtrace with the critic,
whose gradients are compared too), one optimizer step of the real
learner update with real DeepSpeed gives the same gradients and diagnostics (to 1e-5) with one piece on one rank, with k
micro-batches (also with activation checkpointing, packed into rows without padding, with and without
it, and with π_old by a forward of its own where one optimizer step takes it from the loss forward:
learner.compute.old_logprobs_from_loss off), and with 2 ranks (torchrun, gloo) in ZeRO 0 and
ZeRO 2. The samples are stale and
sampled with temperature, top-k and top-p: every loss, gradient and diagnostic stays finite, and the
tokens that fell out of the kept set are counted. (tests/support/learner_grads.py runs the steps.)"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.support.learner_grads import CASES, CRITIC_LR, LR, SAMPLING
from tests.support.ranks import run_module

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("grads")
    module = ["tests.support.learner_grads", out]
    run_module(
        [
            *module,
            "one=100000",
            "k=48",
            "k_checkpointing=48/0/checkpointing",
            "k_whole=48/0/whole",
            "k_packed=48/0/packed",
            "k_packed_checkpointing=48/0/packed+checkpointing",
            "k_separate=48/0/separate",
        ]
    )
    run_module([*module, "ranks=48/0", "ranks_zero2=48/2"], ranks=2)
    return out


def _load(out, label):
    diags = json.loads((out / f"{label}.json").read_text())
    return diags, [load_file(str(out / f"{label}-{i}.safetensors")) for i in range(len(diags))]


@pytest.mark.parametrize(
    "label",
    ["k", "k_whole", "k_checkpointing", "k_packed", "k_packed_checkpointing", "k_separate", "ranks", "ranks_zero2"],
)
def test_same_gradients_and_diagnostics_as_one_piece_on_one_rank(runs, label):
    want_diags, want_grads = _load(runs, "one")
    got_diags, got_grads = _load(runs, label)
    assert len(got_diags) == len(CASES)
    for case, want, got, gw, gg in zip(CASES, want_diags, got_diags, want_grads, got_grads):
        assert got["micro_batches"] >= 3 * want["micro_batches"], case  # really split
        for name in gw:
            # fp32 sums in another order (micro-batches, ranks' all-reduce) differ by a few ulps of the terms
            # summed, which can be far larger than an element of the result: the absolute tolerance scales
            # with the tensor's largest gradient (1e-5 of it), the relative one stays 1e-5
            scale = max(1.0, float(gw[name].abs().max()))
            # and the driver reads each gradient back as (w_before - w_after) / lr: one fp32 ulp of a weight
            # near 1 (the norms' weights) is 2^-23 / lr of gradient, 1.2e-5 at the critic's lr of 0.01 (a sum in
            # another order once moved a critic norm's weight by one ulp: 1.19e-5); two ulps of a weight below 2
            # are the finest difference the readback can show
            readback = 2 * 2**-22 / (CRITIC_LR if name.startswith("critic.") else LR)
            assert torch.allclose(gg[name], gw[name], rtol=1e-5, atol=max(1e-5 * scale, readback)), (
                case,
                name,
                float((gg[name] - gw[name]).abs().max()),
                scale,
            )
        assert max(float(g.abs().max()) for g in gw.values()) > 1e-3, case  # a real gradient, not zeros
        # the global gradient norm before clipping: DeepSpeed's own at ZeRO 2 (over both ranks' partitions),
        # the learner's at ZeRO 0 on one rank; at ZeRO 0 in fp32 with two ranks DeepSpeed keeps none (null)
        assert want["grad_norm"] > 1e-3 and got["lr"] == want["lr"] == LR, case
        if label == "ranks":
            assert got["grad_norm"] is None, case
        for key, value in want.items():
            if key in ("micro_batches", "padding_fraction") or (key == "grad_norm" and label == "ranks"):
                continue
            exact = isinstance(value, dict) or value is None  # None: no sample of staleness 0 in the step
            assert got[key] == (value if exact else pytest.approx(value, rel=1e-5, abs=1e-6)), (case, key)


def test_micro_batches_of_similar_length_cut_the_padding(runs):
    # whole rows (learner.compute.shared_prompt off): micro-batches of samples of similar length
    one, _ = _load(runs, "one")
    k, _ = _load(runs, "k_whole")
    assert one[0]["padding_fraction"] > 0.25 and k[0]["padding_fraction"] < 0.1
    # packed micro-batches (learner.compute.packing): one row each, no padding
    assert all(d["padding_fraction"] == 0.0 for d in _load(runs, "k_packed")[0])


def test_stale_samples_under_top_k_and_top_p_train_finite_and_count_what_fell_out(runs):
    from benchmarks.learner import make_groups
    from broker.protocol.sampling import sampling_logprobs
    from learner.data import collate
    from transformers import AutoModelForCausalLM

    diags, grads = _load(runs, "k")
    for case, diag, g in zip(CASES, diags, grads):
        for key, value in diag.items():
            if value is None:  # a diagnostic without its tokens in this step (mismatch_kl_fresh: none of staleness 0)
                assert key == "mismatch_kl_fresh", (case, key)
                continue
            assert all(math.isfinite(v) for v in (value.values() if isinstance(value, dict) else [value])), (case, key)
        assert all(bool(torch.isfinite(t).all()) for t in g.values()), case
        assert diag["tokens_outside_kept_set"] > 0 and diag["frac_masked"] > 0, case
    # the count of the first step, against the full logits of the initial weights
    model = AutoModelForCausalLM.from_pretrained(runs / "k-model" / "base_model")
    groups = make_groups(8, 4, 12, seed=1, sampling=SAMPLING)
    b = collate(groups, [torch.zeros(4)] * 8, 1, 0)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
    lp = sampling_logprobs(logits, SAMPLING["temperature"], SAMPLING["top_k"], SAMPLING["top_p"])
    taken = lp.gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
    assert diags[0]["tokens_outside_kept_set"] == int((torch.isinf(taken) & b.loss_mask.bool()).sum())
