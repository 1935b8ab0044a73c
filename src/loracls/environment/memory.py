"""A model's memory plan: the per-device training memory a setup will need (`memory_estimate`, for
`loracls doctor --model`), before any hardware is rented."""

from __future__ import annotations

import torch

from loracls.lora import decoder_layers, plan_for_model
from loracls.model import BASE_DTYPE, empty_classifier, resolve_model


def memory_estimate(
    model: str, batch_size: int, max_length: int, precision: str = "fp32", devices: int = 1
) -> dict[str, dict[str, float]]:
    """Rough per-device training memory in GiB for LoRA (attn-qv, r=8) on `model`, three ways: `lora` (the
    whole base on every device, DDP), `qlora` (decoder linear layers in 4-bit NF4, ~0.56 bytes per weight
    with its scales; the rest as the loader keeps it) and `fsdp` (base weights, LoRA and optimizer state
    sharded over `devices`). The frozen weights count at the loader's `BASE_DTYPE`, except that under 16-bit
    `precision` plain LoRA keeps the decoder's linears in 16 bits (`frozen_base: auto`); `precision` also
    sizes the activations.

    Activations follow Korthikanti et al. (2022): about 34·b·s·h + 5·a·s²·b bytes per layer in 16-bit,
    twice that in fp32, per micro-batch of `batch_size` on each device. A planning figure, not a promise:
    allocator overhead and kernels vary.
    """
    skeleton = empty_classifier(resolve_model(model), ["a", "b"])
    config = skeleton.config.get_text_config()
    plan = plan_for_model(model, "attn-qv", 8)
    width = 4 if precision == "fp32" else 2  # bytes per activation
    stored = torch.finfo(BASE_DTYPE).bits // 8  # bytes per frozen weight, as `load_classifier` loads it
    layers = skeleton.get_submodule(decoder_layers(skeleton))
    linear = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    trainable = plan.trainable * 16  # fp32 weights, gradients and two AdamW moments
    per_layer = (
        34 * batch_size * max_length * config.hidden_size
        + 5 * config.num_attention_heads * max_length**2 * batch_size
    )
    activations = per_layer * config.num_hidden_layers * width / 2
    sixteen = 2 if width == 2 else stored  # bytes per decoder linear weight in plain LoRA (`frozen_base`)
    weights = {
        "lora": linear * sixteen + (plan.base_parameters - linear) * stored,
        "qlora": linear * 0.5625 + (plan.base_parameters - linear) * stored,
        "fsdp": plan.base_parameters * stored / devices,
    }
    optimizer = {"lora": trainable, "qlora": trainable, "fsdp": trainable / devices}
    gib = 2**30
    return {
        setup: {
            "weights_gb": weights[setup] / gib,
            "lora_and_optimizer_gb": optimizer[setup] / gib,
            "activations_gb": activations / gib,
            "total_gb": (weights[setup] + optimizer[setup] + activations) / gib,
        }
        for setup in weights
    }
