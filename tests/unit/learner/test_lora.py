"""LoRA in the learner (learner/lora.py): peft adapters on the built-in tiny model, the merged state dict
the learner publishes, and the reference policy with the adapters disabled."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.config import LearnerConfig, LoraConfig
from learner.lora import AdapterDisabled, apply_lora, merged_state_dict, scaling
from learner.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _trained(tiny, cfg: LoraConfig):
    """The tiny model with adapters whose B is no longer zero (as after some steps)."""
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def test_only_the_adapters_train_and_the_merged_model_is_the_adapted_one(tiny):
    cfg = LoraConfig(rank=4, alpha=8.0)
    model = _trained(tiny, cfg)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    merged = merged_state_dict(model.state_dict(), scaling(cfg))
    assert set(merged) == set(base.state_dict())  # the base model's own names: any backend loads it
    base.load_state_dict(merged)
    ids = torch.tensor([[1, 5, 7, 3, 9, 2]])
    with torch.no_grad():
        adapted, served = model(input_ids=ids).logits, base(input_ids=ids).logits
        original = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()(input_ids=ids).logits
    assert torch.allclose(served, adapted, atol=1e-5)
    assert not torch.allclose(served, original, atol=1e-3)  # the adapters changed something


def test_the_reference_is_the_base_model_through_the_same_weights(tiny):
    model = _trained(tiny, LoraConfig(rank=4))
    ids = torch.tensor([[1, 5, 7, 3, 9, 2]])
    with torch.no_grad():
        ref = AdapterDisabled(model)(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()(input_ids=ids).logits
        adapted = model(input_ids=ids).logits
    assert torch.allclose(ref, base, atol=1e-6)
    assert not torch.allclose(adapted, base, atol=1e-3)  # disabled only inside the call


def test_target_modules_by_name_and_clear_errors(tiny):
    model = apply_lora(
        AutoModelForCausalLM.from_pretrained(tiny), LoraConfig(rank=2, target_modules=["q_proj", "v_proj"])
    )
    names = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert names == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="target_modules.*nonexistent"):
        apply_lora(AutoModelForCausalLM.from_pretrained(tiny), LoraConfig(rank=2, target_modules=["nonexistent"]))
    with pytest.raises(ValueError, match="both lora_A and lora_B"):
        merged_state_dict(
            {
                "base_model.model.x.base_layer.weight": torch.zeros(2, 2),
                "base_model.model.x.lora_A.default.weight": torch.zeros(1, 2),
            },
            1.0,
        )


def test_lora_defaults():
    assert LearnerConfig().lora.rank == 0  # off unless asked
    on = LearnerConfig(lora={"rank": 8})
    assert on.optim.lr == pytest.approx(10 * LearnerConfig().optim.lr)  # adapters train at ~10x the full rate
    assert on.critic.lr == pytest.approx(LearnerConfig().optim.lr)  # the critic trains every weight
    assert LearnerConfig(lora={"rank": 8}, optim={"lr": 0.5}).optim.lr == 0.5


@pytest.mark.parametrize("transport", ["collective", "ipc"])
def test_transports_that_hand_over_whole_models_publish_merged_adapters(transport):
    """collective and ipc hand whole models to the engine: `auto` publishes the merged model, and adapters
    published alone are refused at start-up, naming what would be valid."""
    assert not LearnerConfig(lora={"rank": 8}, weights={"transport": transport}).lora_adapters_published
    assert LearnerConfig(lora={"rank": 8}, weights={"transport": "store"}).lora_adapters_published
    with pytest.raises(ValueError, match=f"needs weights.transport store or http .*the {transport} transport"):
        LearnerConfig(lora={"rank": 8, "publish": "adapter"}, weights={"transport": transport})
