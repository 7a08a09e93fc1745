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
