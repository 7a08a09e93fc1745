"""learner/state_codec.py: nested training state to JSON + named tensors and back, without pickle."""

import json
from collections import OrderedDict

import pytest
import torch
from safetensors.torch import load, save

from learner.state_codec import StateCodecError, decode, encode


def _roundtrip(obj):
    """Through the bytes a checkpoint holds: JSON text and a safetensors file."""
    tree, tensors = encode(obj)
    return decode(json.loads(json.dumps(tree, allow_nan=False)), load(save(tensors)))


def test_optimizer_like_state_comes_back_exactly():
    flat = torch.arange(10, dtype=torch.float32) / 3
    obj = {
        "state": {
            0: {
                "step": torch.tensor(3.0),
                "exp_avg": torch.randn(4, 5),
                "exp_avg_sq": torch.rand(4, 5, dtype=torch.bfloat16),
            }
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreach": None, "amsgrad": False}],
        "fp32_groups": [flat[:6], flat[6:]],  # views of one buffer: stored as separate tensors
        "scale": float("inf"),
        "nan": float("nan"),
        "dtype": torch.bfloat16,
        "name": "x",
        "mappings": OrderedDict(a=1, b=2),
    }
    back = _roundtrip(obj)
    st = back["state"][0]
    assert list(back["state"]) == [0]  # int keys stay ints
    assert torch.equal(st["exp_avg"], obj["state"][0]["exp_avg"]) and st["exp_avg_sq"].dtype == torch.bfloat16
    assert st["step"].shape == () and float(st["step"]) == 3.0
    assert back["param_groups"] == obj["param_groups"] and isinstance(back["param_groups"][0]["betas"], tuple)
    assert torch.equal(back["fp32_groups"][1], flat[6:])
    assert back["scale"] == float("inf") and back["nan"] != back["nan"]
    assert back["dtype"] is torch.bfloat16 and back["mappings"] == {"a": 1, "b": 2}


def test_deepspeed_types_are_rebuilt_from_their_fields():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    scaler = DynamicLossScaler(
        init_scale=2.0**16,
        scale_window=1000,
        min_scale=1,
        delayed_shift=2,
        consecutive_hysteresis=False,
        dtype=torch.bfloat16,
    )
    scaler.cur_iter = 17
    back = _roundtrip({"zero_stage": ZeroStageEnum.gradients, "loss_scaler": scaler})
    assert back["zero_stage"] is ZeroStageEnum.gradients
    assert type(back["loss_scaler"]) is DynamicLossScaler and vars(back["loss_scaler"]) == vars(scaler)


@pytest.mark.parametrize(
    "value, kind",
    [
        (object(), "builtins.object"),
        ({1, 2}, "builtins.set"),
        (b"raw", "builtins.bytes"),
        (len, "builtin_function_or_method"),
    ],
)
def test_a_value_without_a_stored_form_is_refused_naming_where_it_is(value, kind):
    with pytest.raises(StateCodecError, match=rf"cannot store state\.groups\.0\.hook .*{kind}.*no pickle"):
        encode({"groups": [{"lr": 1.0, "hook": value}]})


def test_a_key_that_looks_like_a_tag_is_refused():
    with pytest.raises(StateCodecError, match=r"key '\$tensor'"):
        encode({"$tensor": 1})


def test_a_file_naming_an_unknown_type_or_missing_tensor_is_refused():
    with pytest.raises(StateCodecError, match="unknown type 'Popen'"):
        decode({"$object": "Popen", "fields": {}}, {})
    with pytest.raises(StateCodecError, match="lacks"):
        decode({"$tensor": "0:x"}, {})
