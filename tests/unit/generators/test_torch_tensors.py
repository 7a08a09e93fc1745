"""The torch backend's ``update_weights_from_tensors`` (the collective transport): in place, all or nothing;
and ``update_weights`` from the files ``weightstore.check(keep=True)`` mapped (the store transport)."""

import json
from pathlib import Path

import pytest
import torch

from broker.protocol.tensordigest import state_digest
from generators.backends.torch import TorchBackend
from generators.config import TorchBackendConfig
from tests.support.models import needs_gpu


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


def _seal(root, version, state, config_from):
    import shutil

    from broker.protocol import weightstore
    from learner.publish import write_safetensors

    staging = weightstore.staging_dir(root, version)
    known = write_safetensors(staging, state, shard_bytes=1 << 30)
    shutil.copy(Path(config_from) / "config.json", staging / "config.json")
    return weightstore.seal(root, version, staging, known)


def test_mapped_files_give_back_every_tensor_bit_for_bit_whatever_its_alignment(tmp_path):
    """The format does not pad: a float32 tensor after a bf16 one of odd length sits at an offset its dtype
    does not divide. Every tensor, from the mapping the check hashed, equals the published one."""
    from broker.protocol import weightstore
    from generators.backends.torch import mapped_tensors
    from learner.publish import write_safetensors

    g = torch.Generator().manual_seed(3)
    state = {
        "a.weight": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "b": torch.randn(5, generator=g),
        "c.half": torch.randn(3, 3, generator=g).half(),
        "d.ids": torch.arange(6, dtype=torch.int64),
        "e.empty": torch.zeros(0, 4),
        "f.mask": torch.tensor([True, False, True]),
    }
    staging = weightstore.staging_dir(tmp_path, 1)
    path, h = weightstore.seal(tmp_path, 1, staging, write_safetensors(staging, state, shard_bytes=1 << 30))
    v = weightstore.check(path, h, expected_digest=state_digest(state), keep=True)
    got = mapped_tensors(v.files["model.safetensors"])
    assert set(got) == set(state)
    for k, t in state.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
    del got
    v.close()


def test_an_update_loads_the_bytes_its_check_hashed_not_a_file_renamed_in_after(backend, tmp_path):
    """weightstore.check(keep=True) then update_weights(files=...): a safetensors file swapped into the
    version's folder between the check and the load (a rename: what anyone who can write the folder can
    do) is not what the engine loads. Loading by path, as before, would have taken it."""
    import os

    from broker.protocol import weightstore
    from safetensors.torch import save_file

    config_from = tmp_path / "cfg"
    config_from.mkdir()
    (config_from / "config.json").write_text(json.dumps(backend._config))
    published = {k: v + 0.5 for k, v in _published(backend).items()}
    path, h = _seal(tmp_path / "store", 1, published, config_from)
    v = weightstore.check(path, h, expected_digest=state_digest(published), keep=True)
    os.chmod(path, 0o755)
    save_file({k: t + 1.0 for k, t in published.items()}, str(path / "swapped.tmp"))
    os.replace(path / "swapped.tmp", path / "model.safetensors")  # after the check, before the load
    backend.update_weights(str(path), files=v.files)
    v.close()
    assert state_digest(_published(backend)) == state_digest(published)
    backend.update_weights(str(path))  # by path: the swapped file (what the mapped load prevents)
    assert state_digest(_published(backend)) != state_digest(published)


def test_a_gpu_engine_updates_from_the_mapped_bytes_of_a_bf16_version(tmp_path):
    """The same path on CUDA: a bf16 version checked (mapped) on the host, copied into the engine's
    parameters on the GPU; the engine's weights then have the published digest."""
    from broker.protocol import weightstore
    from learner.tiny_model import build_tiny_model

    b = TorchBackend(TorchBackendConfig(device="cuda", dtype="bfloat16"))
    b.load(str(build_tiny_model(tmp_path / "m", seed=0)))
    engine = id(b.model)
    published = {k: (v.float().cpu() + 0.5).to(torch.bfloat16) for k, v in _published(b).items()}
    config_from = tmp_path / "cfg"
    config_from.mkdir()
    (config_from / "config.json").write_text(json.dumps(b._config))
    path, h = _seal(tmp_path / "store", 1, published, config_from)
    v = weightstore.check(path, h, expected_digest=state_digest(published), keep=True)
    b.update_weights(str(path), files=v.files)
    v.close()
    served = {k: t.cpu() for k, t in _published(b).items()}
    assert id(b.model) == engine and all(t.device.type == "cuda" for t in b.model.state_dict().values())
    assert state_digest(served) == state_digest(published)


for _mark in needs_gpu():  # marked gpu, skipped (saying why) where torch sees no GPU
    test_a_gpu_engine_updates_from_the_mapped_bytes_of_a_bf16_version = _mark(
        test_a_gpu_engine_updates_from_the_mapped_bytes_of_a_bf16_version
    )
