"""int8 inference on the CPU: the decoder's linear layers as int8 matmuls (weights quantised per output
channel once, each token's input quantised with its own range at every call), smoothed first so that outlier
input channels do not eat the int8 range, and checked against fp32 on the run's test split before anyone uses
them.

Smoothing is SmoothQuant's (Xiao et al. 2023): for each input channel j of a linear layer, with a_j the
largest |input| seen on calibration texts and w_j the largest |weight| in column j,
s_j = a_j**alpha / w_j**(1-alpha); the layer computes (x / s) @ (W * s).T, equal to x @ W.T in exact
arithmetic, with the outliers moved into the weights. The MLP's output projections (`down_proj`) stay in
float: their input (the gated activation) has outliers smoothing does not tame. Chosen on validation texts
(Gemma 3 270M, the demo classifier, 500 zh reviews; benchmarks/README.md, "int8"): with them in int8 1.6% of
the labels changed, with them in float 0.8%.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from loracls.errors import LoraclsError

RECIPE = "per-token int8, SmoothQuant, down_proj in float (1)"
"""Names the recipe a stored check was made with; a check made with another is measured again."""
ALPHA = 0.5
"""How much of each input channel's range moves into the weights (SmoothQuant's default)."""
KEPT_FLOAT = ("down_proj",)
"""Linear layers (by the end of their name) left in float."""
CALIBRATION_TEXTS = 64
"""Training texts whose activations set the smoothing scales."""
PARITY_TEXTS = 500
"""Test texts (at most) on which int8 is compared with fp32."""
MIN_AGREEMENT = 0.99
"""Share of texts that must get the same label(s) from int8 as from fp32."""
MAX_ACCURACY_DROP = 0.005
"""How much lower int8's test accuracy may be than fp32's."""


class Int8Linear(nn.Module):
    """A linear layer as an int8 matmul: the weight smoothed (times `scale` per input channel) and quantised
    per output channel once; each input row (token) divided by `scale` and quantised with its own range at
    every call, so a text's result does not depend on the texts batched with it. int8 x int8 -> int32 is
    `torch._int_mm` (oneDNN's VNNI/AMX kernels on x86)."""

    def __init__(self, linear: nn.Linear, scale: torch.Tensor):
        super().__init__()
        weight = linear.weight.detach().float() * scale
        weight_scale = weight.abs().amax(1).clamp(min=1e-8) / 127
        quantised = torch.round(weight / weight_scale[:, None]).to(torch.int8)
        self.register_buffer("weight_t", quantised.t())  # (in, out), as _int_mm takes it
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("inverse_scale", 1 / scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = (x.float() * self.inverse_scale).reshape(-1, x.shape[-1])
        row_scale = rows.abs().amax(1, keepdim=True).clamp_(min=1e-8).div_(127)
        quantised = (rows / row_scale).round_().to(torch.int8)
        y = torch._int_mm(quantised, self.weight_t).float().mul_(row_scale).mul_(self.weight_scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def quantized_names(model: nn.Module) -> list[str]:
    """The decoder layers' linear layers int8 replaces (the output head and `KEPT_FLOAT` stay)."""
    names = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and ".layers." in name and not name.endswith(KEPT_FLOAT)
    ]
    if not names:
        raise LoraclsError(f"{type(model).__name__} has no decoder linear layers that int8 could replace")
    return names


@torch.inference_mode()
def input_ranges(model: nn.Module, run_forward: Callable[[], object]) -> dict[str, torch.Tensor]:
    """The largest |input| per channel of each linear layer int8 replaces, over `run_forward()`'s passes."""
    ranges: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
            ranges[name] = torch.maximum(ranges[name], x) if name in ranges else x

        return hook

    hooks = [model.get_submodule(n).register_forward_hook(record(n)) for n in quantized_names(model)]
    try:
        run_forward()
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


@torch.no_grad()
def quantize(model: nn.Module, ranges: dict[str, torch.Tensor], alpha: float = ALPHA) -> nn.Module:
    """`model` (on the CPU) with each linear layer in `ranges` smoothed and replaced by an `Int8Linear`, in
    place; the rest of the model in fp32."""
    if next(model.parameters()).device.type != "cpu":
        raise LoraclsError("int8 inference runs on the CPU; this model is on a GPU")
    names = quantized_names(model)
    missing = sorted(set(names) - set(ranges))
    if missing:
        raise LoraclsError(f"int8 calibration lacks input ranges for {len(missing)} layers: {missing[:3]}...")
    model.float()
    for name in names:
        linear = model.get_submodule(name)
        columns = linear.weight.abs().amax(0).float().clamp(min=1e-5)
        scale = (ranges[name].clamp(min=1e-5) ** alpha / columns ** (1 - alpha)).clamp(min=1e-5)
        parent, child = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), child, Int8Linear(linear, scale))
    return model


def parity(reference: np.ndarray, candidate: np.ndarray, gold: np.ndarray) -> dict:
    """How int8's predictions compare with fp32's: `agreement` (share of texts with the same prediction),
    both accuracies against `gold`, and whether they pass (`MIN_AGREEMENT`, `MAX_ACCURACY_DROP`).

    Predictions and gold are class ids (one per text) or 0/1 rows (multi-label: same row = same labels)."""

    def same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a == b if a.ndim == 1 else (a == b).all(-1)

    agreement = float(same(reference, candidate).mean())
    accuracy = float(same(reference, gold).mean())
    accuracy_int8 = float(same(candidate, gold).mean())
    return {
        "texts": len(gold),
        "agreement": agreement,
        "accuracy_fp32": accuracy,
        "accuracy_int8": accuracy_int8,
        "passed": agreement >= MIN_AGREEMENT and accuracy - accuracy_int8 <= MAX_ACCURACY_DROP,
        "min_agreement": MIN_AGREEMENT,
        "max_accuracy_drop": MAX_ACCURACY_DROP,
        "recipe": RECIPE,
        "alpha": ALPHA,
        "kept_float": list(KEPT_FLOAT),
    }


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def check_key(base_model: str, adapter_sha256: str) -> dict:
    """What a stored parity check holds for: the adapter, the base model's weights (`base_model_identity`),
    the recipe, and the torch build whose int8 kernels it measured (version, oneDNN, CPU capability). A
    check whose key differs in any of them is measured again."""
    onednn = re.search(r"(?:oneDNN|MKL-DNN) (v[\w.]+)", torch.__config__.show())
    return {
        "adapter_sha256": adapter_sha256,
        "base_model": base_model_identity(base_model),
        "recipe": RECIPE,
        "torch": str(torch.__version__),
        "onednn": onednn.group(1) if onednn else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def base_model_identity(base_model: str) -> dict:
    """The base model's weights as files: its config's SHA-256, and each weight file's size and modification
    time (a re-converted or re-downloaded model gets new files). A hub id not in the local cache is only its
    name."""
    folder = Path(base_model)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(base_model, local_files_only=True))
        except Exception:
            return {"name": base_model}
    config = folder / "config.json"
    files = sorted({f for pattern in WEIGHT_FILES for f in folder.glob(pattern)})
    return {
        "name": base_model,
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files},
    }


def check_parity(result: dict, where: str) -> None:
    """Refuse an int8 model that does not match fp32 closely enough."""
    if not result["passed"]:
        raise LoraclsError(
            f"int8 does not match fp32 on {where}'s test split ({result['texts']} texts): same prediction "
            f"on {result['agreement']:.1%} (needs {MIN_AGREEMENT:.0%}), accuracy "
            f"{result['accuracy_int8']:.4f} vs {result['accuracy_fp32']:.4f} (may drop {MAX_ACCURACY_DROP}); "
            "run without --int8"
        )
