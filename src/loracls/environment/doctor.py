"""`loracls doctor`: this machine's facts, a smoke test of real kernels, and the checks a run makes first.

Facts are collected once (`collect_facts`, the only part that reads the machine); the verdicts on them are
`diagnosis.diagnose`. The smoke test runs real kernels in a child process: a GPU kernel that kills its process
(a memory access fault on an architecture the wheel was not built for) becomes a diagnosis, not a crash.
Importing this module imports no torch: `loracls --version` reads `package_version` from it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from rich.console import Console

from loracls.environment.cpu import CPU_PRECISION_FLAGS, cpu_flags
from loracls.environment.diagnosis import Device, Facts, Report, backend_of, diagnose
from loracls.environment.rocm import (
    ROCM_VERSION_FILES,
    base_arch,
    parse_amd_smi_version,
    parse_driver_version,
    parse_rocminfo,
)
from loracls.errors import LoraclsError


def package_version(name: str) -> str | None:
    """An installed distribution's version, None when it is not installed; imports nothing of it."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def collect_facts() -> Facts:
    """Read torch, the environment and the ROCm tools of this machine (each tool only when present)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("HSA_OVERRIDE_GFX_VERSION", "HIP_VISIBLE", "CUDA_VISIBLE", "ROCR_VISIBLE"))
    }
    packages = {
        name: package_version(name) for name in ("transformers", "peft", "accelerate", "bitsandbytes")
    }
    facts = Facts(platform_python(), None, None, None, [], [], env, packages)
    try:
        import torch
    except ImportError:
        return facts
    facts.torch, facts.torch_hip, facts.torch_cuda = torch.__version__, torch.version.hip, torch.version.cuda
    facts.cpu_flags, facts.cpu_machine = sorted(cpu_flags() & CPU_PRECISION_FLAGS), platform.machine()
    facts.mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    if torch.cuda.is_available():
        facts.arch_list = torch.cuda.get_arch_list()
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            arch = (
                getattr(props, "gcnArchName", "") if torch.version.hip else f"sm_{props.major}{props.minor}"
            )
            facts.devices.append(Device(props.name, round(props.total_memory / 2**30, 1), arch))
    facts.system_rocm = next(
        (Path(p).read_text().strip() for p in ROCM_VERSION_FILES if Path(p).is_file()), None
    ) or parse_amd_smi_version(run_tool("amd-smi", "version"))
    facts.rocminfo_gpus, facts.driver = parse_rocminfo(run_tool("rocminfo"))
    facts.driver = (
        facts.driver
        or parse_driver_version(run_tool("rocm-smi", "--showdriverversion"))
        or (
            run_tool("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").strip().splitlines()
            or [None]
        )[0]
    )
    return facts


def platform_python() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def run_tool(*command: str) -> str:
    """A tool's output, or "" when it is missing, fails or hangs."""
    if shutil.which(command[0]) is None:
        return ""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


SMOKE_CODE = r"""
import json, sys, time, torch
device = sys.argv[1]
out = {"device": device}
torch.manual_seed(0)
a, b = torch.randn(512, 512), torch.randn(512, 512)
expected = a @ b
got = (a.to(device) @ b.to(device)).cpu()
out["matmul_max_error"] = float((got - expected).abs().max())
q = torch.randn(2, 4, 16, 32, device=device, requires_grad=True)
attention = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
attention.sum().backward()
out["attention_backward_finite"] = bool(torch.isfinite(q.grad).all())
size = 4096 if device != "cpu" else 512
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(size, size, device=device, dtype=dtype)
    x @ x
    if device != "cpu":
        torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.5 or n < 2:
        x @ x
        n += 1
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out[str(dtype).split(".")[-1] + "_tflops"] = round(2 * size**3 * n / seconds / 1e12, 3)
if device != "cpu":
    try:
        import bitsandbytes as bnb
        layer = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.bfloat16).to(device)
        layer(torch.randn(2, 64, device=device, dtype=torch.bfloat16))
        out["bnb_4bit"] = "ok"
    except ImportError:
        out["bnb_4bit"] = "not installed"
    except Exception as e:
        out["bnb_4bit"] = f"failed: {type(e).__name__}: {e}"[:300]
print(json.dumps(out))
"""


@dataclass
class SmokeResult:
    ok: bool
    details: dict[str, Any]
    diagnosis: str = ""


def run_child(code: str, args: list[str], timeout: float) -> tuple[int | None, str, str]:
    """(return code, stdout, stderr) of `python -c code args`; None as return code on a timeout."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        return None, e.stdout or "", e.stderr or ""
    return done.returncode, done.stdout, done.stderr


def smoke_test(
    device: str, facts: Facts | None = None, timeout: float = 180, code: str = SMOKE_CODE
) -> SmokeResult:
    """Real kernels in a child process: matmul vs the CPU result, a tiny attention + backward, TFLOP/s."""
    returncode, stdout, stderr = run_child(code, [device], timeout)
    hint = crash_hint(facts)
    if returncode is None:
        return SmokeResult(False, {}, f"the smoke test on {device} hung for {timeout:.0f} s. {hint}")
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return SmokeResult(False, {"signal": name}, f"the GPU kernel crashed the process ({name}). {hint}")
    if returncode != 0:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        kind = (
            "the GPU kernel crashed"
            if re.search(
                r"memory access fault|invalid device function|hipError|"
                r"Kernel launch",
                stderr,
                re.I,
            )
            else "the smoke test failed"
        )
        return SmokeResult(False, {"exit_code": returncode}, f"{kind} on {device}: {last}. {hint}")
    details = json.loads(stdout.strip().splitlines()[-1])
    problems = []
    if details["matmul_max_error"] > 1e-2:
        problems.append(f"matmul differs from the CPU result by {details['matmul_max_error']:.3g}")
    if not details["attention_backward_finite"]:
        problems.append("attention backward gave non-finite gradients")
    if problems:
        return SmokeResult(False, details, f"wrong results on {device}: {'; '.join(problems)}. {hint}")
    return SmokeResult(True, details)


def crash_hint(facts: Facts | None) -> str:
    """What a crashing kernel most likely means on this machine, from the verdicts."""
    if facts is None:
        return "Run `loracls doctor` for the likely cause."
    advice = [f.advice for f in diagnose(facts).findings if f.level == "error" and f.advice]
    if advice:
        return "Likely cause and fix: " + advice[0]
    if backend_of(facts) == "rocm":
        archs = ", ".join(base_arch(d.arch) for d in facts.devices)
        return (
            f"Architecture {archs} is in this torch build; check the amdgpu driver against the ROCm release "
            "(`rocminfo`, `dmesg | grep amdgpu`) and that no HSA_OVERRIDE_GFX_VERSION is set."
        )
    return "Check the driver and the torch build (`nvidia-smi`, `python -m torch.utils.collect_env`)."


def check_quantization(device, facts: Facts | None) -> None:
    """`--quantize 4bit` only where bitsandbytes' 4-bit kernels run: a GPU on which a 4-bit layer works."""
    if device.type != "cuda":
        raise LoraclsError(
            f"--quantize 4bit needs a GPU: bitsandbytes' 4-bit kernels run on CUDA (and on ROCm with a build "
            f"that supports it); this run is on {device.type}. Train without --quantize: at this size LoRA "
            "alone fits (`loracls doctor --model M` estimates LoRA, QLoRA and FSDP memory)."
        )
    result = smoke_test(str(device), facts)
    if result.details.get("bnb_4bit") != "ok":
        raise LoraclsError(
            f"--quantize 4bit: bitsandbytes' 4-bit layer does not work on {device} "
            f"({result.details.get('bnb_4bit', 'no result')}). Install a bitsandbytes build for this stack "
            "(`pip install bitsandbytes`; ROCm: a release with ROCm support), or train without --quantize."
        )


def check_before_training(device: str, facts: Facts) -> None:
    """The doctor's smoke test before a GPU run loads any model: a misaligned stack fails in seconds."""
    result = smoke_test(device, facts)
    if not result.ok:
        raise LoraclsError(
            f"GPU smoke test failed: {result.diagnosis} (skip with --no-smoke-test only if you know better)"
        )


@dataclass
class Checkup:
    """What `loracls doctor` found on this machine: facts, verdicts, the smoke test, memory figures."""

    facts: Facts
    report: Report
    device: str
    """`cuda` on a GPU stack (ROCm's too), else `cpu`: where the smoke test ran, what the estimate assumes."""
    smoke: SmokeResult | None
    """None where it was not run (`--no-smoke`, or no torch)."""
    memory: dict = field(default_factory=dict)
    """`free_gb` (`devices.free_memory_gb`) and, for a model, `estimate` (`memory.memory_estimate`), added by
    the caller: they need torch, which this module does not import."""

    @property
    def can_train(self) -> bool:
        return self.report.can_train and (self.smoke is None or self.smoke.ok)

    def to_json(self) -> dict:
        """What `loracls doctor --json` prints."""
        return {
            "facts": asdict(self.facts),
            **self.report.to_json(),
            "smoke_test": asdict(self.smoke) if self.smoke else None,
            "memory": self.memory,
            "can_train": self.can_train,
        }


def checkup(smoke: bool = True) -> Checkup:
    """This machine's facts and verdicts, and with `smoke` (where torch is installed) the smoke test."""
    facts = collect_facts()
    report = diagnose(facts)
    device = "cuda" if report.backend in ("cuda", "rocm") else "cpu"
    return Checkup(facts, report, device, smoke_test(device, facts) if smoke and facts.torch else None)


def print_checkup(found: Checkup, console: Console, devices: int = 8) -> None:
    """What `loracls doctor` prints: each verdict with its advice, the smoke test, memory, the answer.

    `devices` is the FSDP device count the memory estimate was made for."""
    report, result, memory, device = found.report, found.smoke, found.memory, found.device
    colours = {"ok": "green", "warn": "yellow", "error": "bold red"}
    console.print(f"[bold]backend: {report.backend}[/]")
    for f in report.findings:
        console.print(f"[{colours[f.level]}]{f.level:5}[/] {f.topic}: {f.message}", soft_wrap=True)
        if f.advice:
            console.print(f"      -> {f.advice}", soft_wrap=True, highlight=False)
    if result is not None:
        rates = ", ".join(
            f"{k.removesuffix('_tflops')} {v} TFLOP/s"
            for k, v in result.details.items()
            if k.endswith("_tflops")
        )
        verdict = f"[green]ok   [/] smoke test on {device}: matmul, attention + backward correct; {rates}"
        console.print(
            verdict if result.ok else f"[bold red]error[/] smoke test: {result.diagnosis}", soft_wrap=True
        )
        if "bnb_4bit" in result.details:
            console.print(f"      4-bit linear (bitsandbytes, QLoRA): {result.details['bnb_4bit']}")
    if "free_gb" in memory:
        console.print(f"memory free: {memory['free_gb']}")
    for setup, parts in memory.get("estimate", {}).items():
        where = f"per device of {devices}" if setup == "fsdp" else "per device"
        console.print(
            f"memory estimate {setup:5} ({where}): {parts['total_gb']:.2f} GB = weights "
            f"{parts['weights_gb']:.2f} + LoRA/optimizer {parts['lora_and_optimizer_gb']:.3f} + "
            f"activations {parts['activations_gb']:.2f}"
        )
    console.print("[bold green]can train[/]" if found.can_train else "[bold red]cannot train as it is[/]")
