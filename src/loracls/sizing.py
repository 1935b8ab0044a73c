"""What the device runs fastest and what fits: the precision `auto` means, the micro-batch that fits, the
memory a setup will need (`memory_estimate`, for `doctor`), offload's cost.

The micro-batch probe is the one place that runs the model to decide a setting: forward and backward passes
at the longest training length, from the largest divisor of the batch down, until one fits with headroom. A
device whose memory is never exhausted in a catchable way (the CPU: the kernel's OOM killer ends the
process instead) gets a fixed cap instead of a probe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import release_memory
from accelerate.utils.memory import should_reduce_batch_size
from filelock import FileLock

from loracls.cpu import cpu_has_fast_bf16
from loracls.errors import LoraclsError
from loracls.files import write_text

CPU_MICRO_BATCH = 16
"""The micro-batch cap on a CPU: larger ones gain nothing there and pad more within a batch."""

HEADROOM = 0.9
"""A probed micro-batch must peak below this share of the device's memory (evaluation, fragmentation)."""

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
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device_type == "cpu":
        return "bf16" if cpu_has_fast_bf16(flags) else "no"
    return "no"


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


def eval_batch_size(micro_batch_size: int | None) -> int:
    """Examples per inference batch: twice the training micro-batch (no activations are kept for backward)."""
    return 2 * (micro_batch_size or CPU_MICRO_BATCH)


def divisors(n: int, cap: int | None = None) -> list[int]:
    """Divisors of `n` up to `cap`, largest first: the micro-batches that reach `n` exactly."""
    return [d for d in range(min(n, cap or n), 0, -1) if n % d == 0]


def largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> int:
    """The first candidate (largest first) for which `fits` says yes."""
    for n in candidates:
        if fits(n):
            return n
    raise LoraclsError(
        "Not even a micro-batch of 1 fits in the device's memory at the longest training text. Lower "
        "--max-length, turn on --gradient-checkpointing, use --quantize 4bit on a CUDA GPU, or use a larger "
        "device."
    )


def probe_cache() -> Path:
    from loracls.model import cache_dir

    return cache_dir() / "micro_batch.json"


def cache_key(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:16]


def fits_on_device(
    model: torch.nn.Module,
    example: dict[str, torch.Tensor],
    device: torch.device,
    autocast,
    loss: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None,
) -> Callable[[int], bool]:
    """A test for `largest_fitting`: one forward and backward pass of `n` copies of `example`, through the
    training `loss` (default: a loss over all of the model's logits)."""

    def fits(n: int) -> bool:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            batch = {k: v.to(device).repeat(n, *[1] * (v.dim() - 1)) for k, v in example.items()}
            with autocast():
                value = loss(model, batch) if loss else model(**batch).logits.float().logsumexp(-1).mean()
            value.backward()
            del batch, value
            peak = torch.cuda.max_memory_allocated(device)
            return peak <= HEADROOM * torch.cuda.get_device_properties(device).total_memory
        except Exception as e:  # an out-of-memory error of any backend means "no"; anything else is a bug
            if not should_reduce_batch_size(e):
                raise
            return False
        finally:
            model.zero_grad(set_to_none=True)
            release_memory()

    return fits


def probe(
    model: torch.nn.Module,
    example: dict[str, torch.Tensor],
    batch_size: int,
    device: torch.device,
    autocast,
    loss: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None,
) -> int:
    """The largest divisor of `batch_size` whose forward and backward pass fits on `device`.

    The probe's passes draw dropout masks; it runs on a forked RNG so that the run's random stream is the
    same whether the micro-batch was probed (a seed's first run) or read from the cache (every later one).
    """
    if next(model.parameters()).device != device:
        model.to(device)
    was_training = model.training
    model.train()
    devices = [] if device.type != "cuda" else [device.index or torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        found = largest_fitting(divisors(batch_size), fits_on_device(model, example, device, autocast, loss))
    model.train(was_training)
    return found


def micro_batch_size(
    requested: int | None,
    batch_size: int,
    accelerator: Accelerator,
    model: torch.nn.Module,
    example: dict[str, torch.Tensor],
    key: tuple,
    loss: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None,
) -> tuple[int, str]:
    """The micro-batch to train with and how it was chosen (`set`, `cpu cap`, `probed`, `cached`).

    `example` is the longest training text (a collated batch of one); `key` names what the memory depends
    on besides the device (model, length, precision, LoRA targets, checkpointing); `loss` is the training
    objective's (see `fits_on_device`).
    """
    if requested is not None:
        return requested, "set"
    device = accelerator.device
    if device.type != "cuda":
        return divisors(batch_size, CPU_MICRO_BATCH)[0], "cpu cap"
    if accelerator.is_fsdp2:  # the whole model on one device, as the probe runs it, may not fit
        return divisors(batch_size, CPU_MICRO_BATCH)[0], "FSDP: not probed"
    props = torch.cuda.get_device_properties(device)
    key_text = cache_key(*key, props.name, props.total_memory, batch_size, accelerator.num_processes)
    path = probe_cache()
    cached = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if key_text in cached:
        found, how = int(cached[key_text]), "cached"
    else:
        found, how = probe(model, example, batch_size, device, accelerator.autocast, loss), "probed"
    if accelerator.num_processes > 1:  # every process must accumulate the same number of micro-batches
        found = int(accelerator.gather(torch.tensor([found], device=device)).min())
    if how == "probed" and accelerator.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path.with_name(path.name + ".lock"))):  # another run may add its own key meanwhile
            cached = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            cached[key_text] = found
            write_text(path, json.dumps(cached, indent=1))
    return found, how


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


def memory_estimate(
    model: str, batch_size: int, max_length: int, precision: str = "fp32", devices: int = 1
) -> dict[str, dict[str, float]]:
    """Rough per-device training memory in GiB for LoRA (attn-qv, r=8) on `model`, three ways: `lora` (the
    whole base on every device, DDP), `qlora` (decoder linear layers in 4-bit NF4, ~0.56 bytes per weight
    with its scales; the rest as the loader keeps it) and `fsdp` (base weights, LoRA and optimizer state
    sharded over `devices`). The frozen weights count at the loader's `BASE_DTYPE` (whatever `precision`
    the activations are computed in); `precision` sizes the activations.

    Activations follow Korthikanti et al. (2022): about 34·b·s·h + 5·a·s²·b bytes per layer in 16-bit,
    twice that in fp32, per micro-batch of `batch_size` on each device. A planning figure, not a promise:
    allocator overhead and kernels vary.
    """
    from loracls.lora import decoder_layers, plan_for_model
    from loracls.model import BASE_DTYPE, empty_classifier, resolve_model

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
    weights = {
        "lora": plan.base_parameters * stored,
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


def free_memory_gb() -> dict[str, float]:
    """Free memory per GPU, or available host memory when there is no GPU."""
    import psutil

    if torch.cuda.is_available():
        return {
            f"cuda:{i}": round(torch.cuda.mem_get_info(i)[0] / 2**30, 1)
            for i in range(torch.cuda.device_count())
        }
    return {"cpu": round(psutil.virtual_memory().available / 2**30, 1)}
