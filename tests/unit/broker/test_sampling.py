import torch

from broker.protocol.sampling import sampling_logprobs


def test_temperature_top_k_top_p_give_a_normalised_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    lp = sampling_logprobs(logits, temperature=0.5)
    assert torch.allclose(lp, torch.log_softmax(logits / 0.5, -1))
    lp = sampling_logprobs(logits, top_k=2)
    assert torch.isinf(lp[0, 2:]).all() and torch.allclose(lp.exp().sum(), torch.tensor(1.0))
    # probabilities ~ [.52, .19, .12, .03, .07]: top_p=0.6 keeps the first two tokens
    lp = sampling_logprobs(logits, top_p=0.6)
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()
    assert torch.allclose(lp.exp().sum(), torch.tensor(1.0))


def test_sample_draws_each_token_with_its_probability_and_never_one_outside_the_kept_set():
    from broker.protocol.sampling import sample

    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, -3.0])
    lp = sampling_logprobs(logits.expand(100_000, -1), top_k=5)  # the last token is cut
    g = torch.Generator().manual_seed(0)
    tok = sample(lp, g)
    assert tok.shape == (100_000,) and int(tok.max()) < 5
    freq = torch.bincount(tok, minlength=6).double() / len(tok)
    p = lp[0].exp().double()
    sigma = (p * (1 - p) / len(tok)).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-12).all(), (freq, p)
    # the same generator state draws the same tokens; greedy (top_k=1) always draws the argmax
    assert torch.equal(
        sample(lp[:50], torch.Generator().manual_seed(3)), sample(lp[:50], torch.Generator().manual_seed(3))
    )
    greedy = sampling_logprobs(torch.randn(64, 1000), top_k=1)
    assert torch.equal(sample(greedy, g), greedy.argmax(-1))
