"""The tensor digest: the same tensors give the same digest however they are split or ordered; any
changed byte, name, dtype or shape changes it."""

import pytest
import torch

from broker.protocol.tensordigest import combine, state_digest, torch_entry


def _state():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
            "scale": torch.tensor(2.0)}


def test_order_and_split_do_not_matter():
    s = _state()
    d = state_digest(s)
    assert d == combine(reversed([torch_entry(k, v) for k, v in s.items()]))
    assert d == state_digest(dict(reversed(list(s.items()))))


@pytest.mark.parametrize("change", ["byte", "name", "dtype", "shape", "missing"])
def test_any_change_is_seen(change):
    s = _state()
    d = state_digest(s)
    t = dict(s)
    if change == "byte":
        raw = t["b.bias"].clone()
        raw.view(torch.int16)[2] ^= 1  # one bit of one bf16 value
        t["b.bias"] = raw
    elif change == "name":
        t["c.bias"] = t.pop("b.bias")
    elif change == "dtype":
        t["a.weight"] = t["a.weight"].double()
    elif change == "shape":
        t["a.weight"] = t["a.weight"].reshape(3, 4)
    else:
        del t["scale"]
    assert state_digest(t) != d


def test_duplicate_names_are_an_error():
    e = torch_entry("x", torch.zeros(2))
    with pytest.raises(ValueError):
        combine([e, e])
