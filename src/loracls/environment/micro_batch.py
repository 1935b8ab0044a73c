"""The micro-batch that fits, and the batch inference runs at.

The micro-batch probe is the one place that runs the model to decide a setting: forward and backward passes
at the longest training length, from the largest divisor of the batch down, until one fits with headroom. A
device whose memory is never exhausted in a catchable way (the CPU: the kernel's OOM killer ends the
process instead) gets a fixed cap instead of a probe.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import release_memory
from accelerate.utils.memory import should_reduce_batch_size
from filelock import FileLock

from loracls.errors import LoraclsError
from loracls.files import write_text
from loracls.model import cache_dir

CPU_MICRO_BATCH = 16
"""The micro-batch cap on a CPU: larger ones gain nothing there and pad more within a batch."""

HEADROOM = 0.9
"""A probed micro-batch must peak below this share of the device's memory (evaluation, fragmentation)."""


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
