"""What this CPU computes fast: bf16 in hardware (AVX-512-BF16, AMX) or emulated, int8 dot products (VNNI,
AMX) or a slow fallback. `--precision auto` and `--int8` follow these flags; `benchmarks/cpu_precisions.py`
measures what they stand on. Free of torch, so that `loracls doctor` can report them without it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from loracls.errors import LoraclsError

BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
"""x86 flags of bf16 matmuls in hardware."""

INT8_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}
"""x86 flags of the int8 dot-product instructions oneDNN's int8 matmul kernels use."""

CPU_PRECISION_FLAGS = BF16_FLAGS | INT8_FLAGS | {"avx2", "avx512f", "amx_tile"}
"""The flags that decide what a CPU runs fast (recorded by `doctor` and with every benchmark result)."""

SLOW_CPU_OVERRIDE = "LORACLS_SLOW_CPU_OK"
"""Set to 1 to run `--int8` on a CPU without int8 dot-product instructions anyway (the tests; checking an
export's numbers on a machine it will not be served from)."""


def cpu_flags() -> set[str]:
    """The CPU feature flags the kernel reports (Linux); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_has_fast_bf16(flags: set[str] | None = None) -> bool:
    """bf16 matmuls in hardware (AVX-512-BF16 or AMX); without them bf16 is emulated, far slower than fp32."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & BF16_FLAGS)


def cpu_has_fast_int8(flags: set[str] | None = None, machine: str | None = None) -> bool:
    """int8 matmuls in hardware. On an x86 CPU without VNNI or AMX, `torch._int_mm` falls back to a slow
    kernel, many times slower than fp32 (measured on an AVX2 CPU: benchmarks/README.md, "CPU precisions").
    Other architectures are not measured and are not refused."""
    flags = cpu_flags() if flags is None else flags
    machine = platform.machine() if machine is None else machine
    if machine.lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    return bool(flags & INT8_FLAGS)


def check_int8_cpu(flags: set[str] | None = None, machine: str | None = None) -> None:
    """Refuse `--int8` where it would be far slower than fp32, unless `SLOW_CPU_OVERRIDE` is set."""
    if os.environ.get(SLOW_CPU_OVERRIDE) == "1" or cpu_has_fast_int8(flags, machine):
        return
    raise LoraclsError(
        "--int8 needs int8 dot-product instructions (AVX-512-VNNI, AVX-VNNI or AMX), which this CPU lacks: "
        "torch's int8 matmul then falls back to a slow kernel, many times slower than fp32 (measured on an "
        'AVX2 CPU: benchmarks/README.md, "CPU precisions"). Drop --int8: fp32 is the fast path on '
        "this CPU. To run it anyway (e.g. to check an export you will serve elsewhere), set "
        f"{SLOW_CPU_OVERRIDE}=1."
    )


def emulated_bf16_warning(precision: str, device_type: str, flags: set[str] | None = None) -> str | None:
    """A warning when bf16 is asked for on a CPU that emulates it (`auto` never picks it there)."""
    if precision != "bf16" or device_type != "cpu" or cpu_has_fast_bf16(flags):
        return None
    return (
        "precision bf16 on a CPU without AVX-512-BF16 or AMX: bf16 is emulated there, several times slower "
        'than fp32 (measured on an AVX2 CPU: benchmarks/README.md, "CPU precisions"); use --precision auto '
        "(fp32 on this CPU)"
    )
