"""What every benchmark result records: the command, the code, the machine, the versions and the date."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from loracls.environment.cpu import CPU_PRECISION_FLAGS, cpu_flags, cpu_has_fast_bf16
from loracls.training import fit
from loracls.training.runs import environment

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    facts = {
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_bf16": cpu_has_fast_bf16(),
        "cpu_avx512": "avx512f" in cpu_flags(),
        "cpu_flags": sorted(cpu_flags() & CPU_PRECISION_FLAGS),
        "device": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts |= {"gpu": props.name, "gpu_memory_gb": round(props.total_memory / 2**30, 1)}
    return facts


def peak_memory_gb(device: torch.device) -> float:
    """Peak GPU memory allocated, or the process's peak resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return fit.peak_memory_gb()["peak_rss_gb"]


def git_state() -> tuple[str | None, bool]:
    """The commit that runs, and whether src/ differs from it."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True, text=True).stdout
    return commit or None, bool(dirty.strip())


CODE = git_state()
"""Read when a benchmark starts: edits made while it runs do not change what it measured."""


def write_result(path: Path, result: dict) -> None:
    commit, dirty = CODE
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        **result,
        "git": commit,
        "src_modified": dirty,
        "machine": machine(),
        "env": environment(device),
        "date": time.strftime("%Y-%m-%d"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"written to {path}")


def fitted_flops(run, lengths: list[int]) -> tuple[float, dict]:
    """FLOPs of `run(input_ids)` over unpadded texts of these lengths: counted with `FlopCounterMode` at 32
    and 128 tokens, fitted as a*L + b*L^2 per text (linear layers, attention), summed over `lengths`."""
    counted = {}
    for n in (32, 128):
        with FlopCounterMode(display=False) as counter:
            run(torch.randint(10, 1000, (1, n)))
        counted[n] = counter.get_total_flops()
    b = (counted[128] / 128 - counted[32] / 32) / (128 - 32)
    a = counted[32] / 32 - b * 32
    fit = {"per_token": a, "per_token_squared": b, "counted": counted}
    return sum(a * n + b * n * n for n in lengths), fit
