"""The torch backend's ``update_weights_from_tensors`` (the collective transport): in place, all or nothing."""

import pytest
import torch

from broker.protocol.tensordigest import state_digest
from generators.backends.torch import TorchBackend
from generators.config import TorchBackendConfig


def _published(b: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in b.model.state_dict().items() if k != "lm_head.weight"}  # tied: not published


@pytest.fixture
def backend(tmp_path):
    from learner.tiny_model import build_tiny_model

    b = TorchBackend(TorchBackendConfig())
    b.load(str(build_tiny_model(tmp_path, seed=0)))
    return b


def test_tensors_are_copied_into_the_same_model_in_place(backend):
    engine, before = id(backend.model), _published(backend)
    new = {k: v + 0.5 for k, v in before.items()}
    backend.update_weights_from_tensors(new)
    assert id(backend.model) == engine and state_digest(_published(backend)) == state_digest(new)
    # the tied head follows the embeddings
    assert torch.equal(backend.model.lm_head.weight, new["model.embed_tokens.weight"])


def test_a_mismatched_set_changes_nothing_and_says_what_is_wrong(backend):
    before = _published(backend)
    bad = {k: v + 0.5 for k, v in before.items()}
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="wrong shape.*model.norm.weight"):
        backend.update_weights_from_tensors(bad)
    missing = {k: v for k, v in bad.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        backend.update_weights_from_tensors(missing)
    assert state_digest(_published(backend)) == state_digest(before)


def test_adopting_takes_the_buffers_without_a_copy_only_when_every_dtype_matches(backend):
    """adopt=True (the collective's staging buffer): the same Parameter objects now view the given
    tensors (tied head included) and generate from them; a tensor in another dtype means a plain copy."""
    params = dict(backend.model.named_parameters())
    new = {k: v + 0.25 for k, v in _published(backend).items()}
    assert backend.update_weights_from_tensors(new, adopt=True) is True
    assert dict(backend.model.named_parameters()) == params  # the same objects
    for k, p in params.items():
        assert p.data_ptr() == new[k].data_ptr(), k
    assert backend.model.lm_head.weight.data_ptr() == new["model.embed_tokens.weight"].data_ptr()
    halves = {k: v.half() for k, v in _published(backend).items()}
    assert backend.update_weights_from_tensors(halves, adopt=True) is False  # fp32 model: copied, converted
    assert all(p.data_ptr() != halves[k].data_ptr() for k, p in params.items())
    assert state_digest(_published(backend)) == state_digest({k: v.float() for k, v in halves.items()})
