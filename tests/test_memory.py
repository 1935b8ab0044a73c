"""The memory plan: `memory_estimate`'s figures grow with the batch, shrink with 4-bit and sharding, and count
the weights as the loader loads them."""

import pytest
import torch

from loracls.environment import memory


def test_memory_estimate_for_the_tiny_model(tiny_models):
    small = memory.memory_estimate(str(tiny_models["llama"]), batch_size=8, max_length=64)["lora"]
    large = memory.memory_estimate(str(tiny_models["llama"]), batch_size=16, max_length=128)["lora"]
    assert 0 < small["total_gb"] < large["total_gb"]
    assert large["activations_gb"] > 2 * small["activations_gb"]


def test_memory_estimate_for_qlora_and_fsdp(tiny_models):
    setups = memory.memory_estimate(str(tiny_models["llama"]), 8, 64, precision="bf16", devices=4)
    lora, qlora, fsdp = setups["lora"], setups["qlora"], setups["fsdp"]
    assert qlora["weights_gb"] < lora["weights_gb"]  # 4-bit decoder linears
    assert fsdp["weights_gb"] == pytest.approx(lora["weights_gb"] / 4, abs=1e-3)
    assert fsdp["activations_gb"] == lora["activations_gb"]  # a micro-batch per device either way


@pytest.mark.slow
def test_memory_plan_for_gemma3_270m():
    setups = memory.memory_estimate("gemma3-270m", 16, 256, precision="bf16", devices=8)
    # 268M weights as training keeps them in bf16: 168M embeddings in fp32, 100M decoder linears in bf16
    # (frozen_base: auto): 0.81 GiB; 4-bit shrinks the linears further; FSDP keeps them all in fp32
    assert setups["lora"]["weights_gb"] == pytest.approx(0.81, abs=0.01)
    assert 0.65 < setups["qlora"]["weights_gb"] < 0.75
    assert setups["fsdp"]["weights_gb"] == pytest.approx(1.0 / 8, abs=0.01)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_planned_weights_are_what_the_loader_loads(tiny_models, precision):
    """The planner once counted a GPU's frozen weights at bf16 while `load_classifier` loaded fp32: it
    promised half the weight memory a run then used. Training in bf16 now keeps the decoder's linears so."""
    from loracls.lora import frozen_linears_in
    from loracls.model import load_classifier

    path = str(tiny_models["llama"])
    planned = memory.memory_estimate(path, 8, 64, precision=precision)["lora"]["weights_gb"] * 2**30
    model = load_classifier(path, ["a", "b"], mixed_precision="bf16" if precision == "bf16" else "no")
    if precision == "bf16":
        assert frozen_linears_in(model.requires_grad_(False), torch.bfloat16) == 14  # 7 linears, 2 layers
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())  # the plan counts the head too
    assert planned == pytest.approx(loaded, rel=1e-6)
