"""What the device runs fastest and what it holds: the precision `auto` means, where inference runs and
its autocast, what the launch configuration offloads to the CPU (and what that costs), free memory.

Light on purpose: `loracls doctor` imports it (free memory) without transformers or peft.
"""

from __future__ import annotations

import contextlib

import torch
from accelerate import Accelerator

from loracls.environment.cpu import cpu_has_fast_bf16

OFFLOAD_COST = (
    "CPU offload moves parameters or optimizer state over PCIe at every step: in the write-up this tool "
    "starts from, it made a LoRA training step 6x slower (0.8 s -> 5 s on an MI210). LoRA's optimizer state "
    "is tiny; a smaller micro-batch with gradient accumulation (loracls' default: `--micro-batch-size` unset "
    "finds the largest that fits) or `--gradient-checkpointing` saves memory at a fraction of that cost."
)


def mixed_precision(precision: str, device_type: str | None = None, flags: set[str] | None = None) -> str:
    """accelerate's name (`no`, `bf16`, `fp16`) for `precision`; `auto` is the fastest the device supports."""
    if precision != "auto":
        return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision]
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        return "bf16" if gpu_has_fast_bf16() else "fp16"
    if device_type == "cpu":
        return "bf16" if cpu_has_fast_bf16(flags) else "no"
    return "no"


ROCM_BF16_ARCHS = ("gfx908", "gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")
"""AMD architectures (prefixes of `gcnArchName`) whose matrix units compute bf16: CDNA 1-4 (MI100 to MI355)
and RDNA 3-4. Older ones (gfx906 MI50/MI60, gfx900, RDNA 1-2 gfx10xx) emulate it, slower than fp16."""


def gpu_has_fast_bf16() -> bool:
    """Whether the GPU computes bf16 in hardware, not emulated: `torch.cuda.is_bf16_supported()` answers yes
    on every ROCm GPU and, by emulation, on pre-Ampere CUDA GPUs (V100, T4), where fp16 is the fast one."""
    device = torch.cuda.current_device()
    if torch.version.hip:
        arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
        return arch.split(":", 1)[0].startswith(ROCM_BF16_ARCHS)
    return torch.cuda.get_device_properties(device).major >= 8


def inference_device() -> torch.device:
    """Where inference runs by default: a CUDA/ROCm GPU, else Apple's MPS, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def inference_autocast(device: torch.device, precision: str = "auto") -> contextlib.AbstractContextManager:
    """Autocast for inference: by default to the fastest precision the device supports (`precision: auto`)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision(precision, device.type))
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def offload_in_use(accelerator: Accelerator) -> str | None:
    """What the launch configuration offloads to the CPU (FSDP or DeepSpeed), or None."""
    state = accelerator.state
    fsdp = getattr(state, "fsdp_plugin", None)
    if fsdp is not None and getattr(getattr(fsdp, "cpu_offload", None), "offload_params", False):
        return "FSDP parameter offload (fsdp_offload_params)"
    deepspeed = getattr(state, "deepspeed_plugin", None)
    if deepspeed is not None:
        zero = deepspeed.deepspeed_config.get("zero_optimization", {})
        for part in ("offload_optimizer", "offload_param"):
            if zero.get(part, {}).get("device") in ("cpu", "nvme"):
                return f"DeepSpeed {part} to {zero[part]['device']}"
    return None


def free_memory_gb() -> dict[str, float]:
    """Free memory per GPU, or available host memory when there is no GPU."""
    import psutil

    if torch.cuda.is_available():
        return {
            f"cuda:{i}": round(torch.cuda.mem_get_info(i)[0] / 2**30, 1)
            for i in range(torch.cuda.device_count())
        }
    return {"cpu": round(psutil.virtual_memory().available / 2**30, 1)}
