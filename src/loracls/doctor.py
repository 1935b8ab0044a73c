"""`loracls doctor`: is this GPU stack (ROCm, CUDA) or CPU able to train, and if not, what to change.

Facts are collected once (`collect_facts`, the only part that touches the machine); every verdict is a pure
function of them (`diagnose`), so the decisions are tested on recorded outputs of MI210, MI300X, Radeon and
NVIDIA machines. The smoke test runs real kernels in a child process: a GPU kernel that kills its process
(a memory access fault on an architecture the wheel was not built for) becomes a diagnosis, not a crash.
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

from loracls.cpu import CPU_PRECISION_FLAGS, cpu_flags, cpu_has_fast_bf16, cpu_has_fast_int8
from loracls.errors import LoraclsError
from loracls.rocm import (
    ISA_FAMILIES,
    ROCM_VERSION_FILES,
    base_arch,
    gfx_from_hsa,
    hsa_version,
    major_minor,
    parse_amd_smi_version,
    parse_driver_version,
    parse_rocminfo,
)


@dataclass
class Device:
    name: str
    memory_gb: float
    arch: str
    """`gcnArchName` on ROCm (e.g. `gfx90a:sramecc+:xnack-`), `sm_XY` on CUDA."""


@dataclass
class Facts:
    """Everything the verdicts depend on, as plain data (recordable, and replayable in tests)."""

    python: str
    torch: str | None
    torch_hip: str | None
    torch_cuda: str | None
    arch_list: list[str]
    devices: list[Device]
    env: dict[str, str]
    """HSA_OVERRIDE_GFX_VERSION[_N], HIP/CUDA/ROCR_VISIBLE_DEVICES."""
    packages: dict[str, str | None]
    system_rocm: str | None = None
    """The ROCm release installed on the system (/opt/rocm/.info/version, or amd-smi)."""
    driver: str | None = None
    """The amdgpu kernel driver (rocminfo's "ROCk module version", or rocm-smi) or the NVIDIA driver."""
    rocminfo_gpus: list[str] = field(default_factory=list)
    """The gfx names rocminfo reports: what the runtime sees, even when torch sees no GPU."""
    mps: bool = False
    cpu_flags: list[str] = field(default_factory=list)
    """The CPU's bf16 and int8 instruction flags (`CPU_PRECISION_FLAGS`): what `auto` and `--int8` use."""
    cpu_machine: str = ""
    """`platform.machine()`: x86_64, aarch64, ..."""

    @classmethod
    def from_json(cls, data: dict) -> Facts:
        return cls(**{**data, "devices": [Device(**d) for d in data.get("devices", [])]})


@dataclass
class Finding:
    level: str
    """`ok`, `warn` or `error` (an error means the stack cannot train as it is)."""
    topic: str
    message: str
    advice: str = ""


@dataclass
class Report:
    backend: str
    findings: list[Finding]

    @property
    def can_train(self) -> bool:
        return not any(f.level == "error" for f in self.findings)

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "can_train": self.can_train,
            "findings": [asdict(f) for f in self.findings],
        }


def backend_of(facts: Facts) -> str:
    if facts.devices and facts.torch_hip:
        return "rocm"
    if facts.devices and facts.torch_cuda:
        return "cuda"
    return "mps" if facts.mps else "cpu"


def diagnose(facts: Facts) -> Report:
    """The verdicts, most important first; pure, so every machine in the tests gets a verdict."""
    backend = backend_of(facts)
    findings: list[Finding] = []
    if facts.torch is None:
        return Report(backend, [Finding("error", "torch", "torch is not installed", install_advice(facts))])
    if backend == "rocm":
        findings += check_rocm_versions(facts)
        findings += check_architectures(facts)
    elif backend == "cuda":
        findings += check_cuda(facts)
    else:
        findings += check_no_gpu(facts)
    findings += check_packages(facts, backend)
    return Report(backend, findings)


def install_advice(facts: Facts) -> str:
    rocm = major_minor(facts.system_rocm)
    if rocm:
        return (
            f"ROCm {rocm[0]}.{rocm[1]} is installed: pip install torch --index-url "
            f"https://download.pytorch.org/whl/rocm{rocm[0]}.{rocm[1]}"
        )
    return "pip install torch==2.13.0 (CPU), or the CUDA/ROCm wheel for your GPU (see the README)"


def check_rocm_versions(facts: Facts) -> list[Finding]:
    torch_rocm, system = major_minor(facts.torch_hip), major_minor(facts.system_rocm)
    shown = f"torch {facts.torch} is built for ROCm {facts.torch_hip} (HIP underneath the `cuda` API)"
    if system is None:
        return [Finding("ok", "rocm", shown + "; no system ROCm release found (the wheel brings its own)")]
    if torch_rocm != system:
        return [
            Finding(
                "warn",
                "rocm",
                f"{shown}, but the system has ROCm {facts.system_rocm}",
                "The wheel ships its own ROCm user-space libraries, but tools, the kernel driver and "
                "libraries loaded from /opt/rocm (rccl, hipblaslt plugins) follow the system release: a "
                "mismatch shows up as 'HIP error: invalid device function' or hangs. Install the wheel for "
                "the system release: "
                f"pip install torch --index-url https://download.pytorch.org/whl/rocm{system[0]}.{system[1]}",
            )
        ]
    driver = f"; amdgpu driver {facts.driver}" if facts.driver else ""
    return [Finding("ok", "rocm", f"{shown}, matching the system ROCm {facts.system_rocm}{driver}")]


def check_architectures(facts: Facts) -> list[Finding]:
    """Each GPU's gfx architecture against the wheel's; HSA_OVERRIDE_GFX_VERSION only where it helps."""
    built = {base_arch(a) for a in facts.arch_list}
    findings = []
    archs = [base_arch(d.arch) for d in facts.devices]
    for index, (device, gfx) in enumerate(zip(facts.devices, archs, strict=True)):
        override = facts.env.get(f"HSA_OVERRIDE_GFX_VERSION_{index}") or facts.env.get(
            "HSA_OVERRIDE_GFX_VERSION"
        )
        label = f"GPU {index} {device.name} ({gfx}, {device.memory_gb:.0f} GB)"
        if gfx in built:
            if override:
                findings.append(
                    Finding(
                        "warn",
                        "override",
                        f"{label}: HSA_OVERRIDE_GFX_VERSION={override} is set, but {gfx} is in this torch "
                        "build and needs no override",
                        f"unset HSA_OVERRIDE_GFX_VERSION: it makes the runtime load {gfx_from_hsa(override)} "
                        f"kernels on a {gfx}, which can fault or compute wrong results",
                    )
                )
            else:
                findings.append(Finding("ok", "arch", f"{label}: in this torch build; no override needed"))
            continue
        sibling = next(
            (base for base, members in ISA_FAMILIES.items() if gfx in members and base in built), None
        )
        if override:
            target = gfx_from_hsa(override)
            if target is None:
                findings.append(
                    Finding(
                        "error",
                        "override",
                        f"HSA_OVERRIDE_GFX_VERSION={override} is malformed",
                        "use decimal major.minor.stepping, e.g. 10.3.0 (gfx90a would be 9.0.10)",
                    )
                )
            elif hsa_version(target).split(".")[0] != hsa_version(gfx).split(".")[0]:
                findings.append(
                    Finding(
                        "error",
                        "override",
                        f"{label}: HSA_OVERRIDE_GFX_VERSION={override} ({target}) crosses a major version",
                        "kernels of another generation do not run correctly; "
                        + (
                            f"use HSA_OVERRIDE_GFX_VERSION={hsa_version(sibling)}"
                            if sibling
                            else "this architecture has no supported sibling in the build"
                        ),
                    )
                )
            elif target in built:
                findings.append(
                    Finding(
                        "ok",
                        "override",
                        f"{label}: not in this build; runs as {target} through "
                        f"HSA_OVERRIDE_GFX_VERSION={override}",
                    )
                )
            else:
                findings.append(
                    Finding(
                        "error",
                        "override",
                        f"{label}: HSA_OVERRIDE_GFX_VERSION={override} names {target}, "
                        "which this torch build does not contain either",
                        f"built: {', '.join(sorted(built))}",
                    )
                )
            continue
        if sibling:
            mixed = len(set(archs)) > 1
            findings.append(
                Finding(
                    "error",
                    "arch",
                    f"{label}: {gfx} is not in this torch build (built: {', '.join(sorted(built))}); the "
                    "first kernel would fail with 'invalid device function' or a memory access fault",
                    f"export HSA_OVERRIDE_GFX_VERSION={hsa_version(sibling)} (runs it as {sibling}, same ISA)"
                    + (
                        f"; with several different GPUs set it per device: HSA_OVERRIDE_GFX_VERSION_{index}="
                        f"{hsa_version(sibling)} (ROCm 6.2+)"
                        if mixed
                        else ""
                    ),
                )
            )
        else:
            findings.append(
                Finding(
                    "error",
                    "arch",
                    f"{label}: {gfx} is not in this torch build (built: {', '.join(sorted(built))}) and "
                    "has no ISA-compatible sibling there",
                    "install a torch wheel for a newer ROCm release that lists this architecture; an "
                    "override to another family would compute wrong results or fault",
                )
            )
    return findings


def check_cuda(facts: Facts) -> list[Finding]:
    built = set(facts.arch_list)
    findings = [
        Finding(
            "ok",
            "cuda",
            f"torch {facts.torch} built for CUDA {facts.torch_cuda}"
            + (f"; NVIDIA driver {facts.driver}" if facts.driver else ""),
        )
    ]
    for index, device in enumerate(facts.devices):
        label = f"GPU {index} {device.name} ({device.arch}, {device.memory_gb:.0f} GB)"
        # a build with sm_XY kernels also runs on later minor revisions of the same major (PTX aside)
        same_major = any(a.startswith(device.arch[:-1]) for a in built if a.startswith("sm_"))
        if device.arch in built or same_major:
            findings.append(Finding("ok", "arch", f"{label}: kernels in this torch build"))
        else:
            findings.append(
                Finding(
                    "error",
                    "arch",
                    f"{label}: this torch build has no kernels for {device.arch} "
                    f"(built: {', '.join(sorted(built))})",
                    "install a torch wheel built for a newer CUDA release that supports this GPU",
                )
            )
    return findings


def check_no_gpu(facts: Facts) -> list[Finding]:
    if facts.rocminfo_gpus:
        return [
            Finding(
                "error",
                "rocm",
                f"rocminfo sees {', '.join(facts.rocminfo_gpus)} but torch sees no GPU "
                f"(torch {facts.torch}, HIP {facts.torch_hip or 'none: a CPU or CUDA build'})",
                install_advice(facts)
                if not facts.torch_hip
                else "check that the user is in the 'render' and 'video' groups and that "
                "HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES do not hide the GPU",
            )
        ]
    if facts.mps:
        return [Finding("ok", "mps", "Apple GPU (MPS): trains in fp32; no bf16 autocast")]
    flags = set(facts.cpu_flags)
    precision = "bf16" if cpu_has_fast_bf16(flags) else "fp32"
    why = "AVX-512-BF16/AMX" if precision == "bf16" else "no AVX-512-BF16 or AMX: bf16 would be emulated"
    findings = [
        Finding(
            "ok",
            "cpu",
            f"no GPU: training runs on the CPU in {precision} ({why}; small models and data only)",
        )
    ]
    if not cpu_has_fast_int8(flags, facts.cpu_machine or "unknown"):
        findings.append(
            Finding(
                "warn",
                "int8",
                "no int8 dot-product instructions (AVX-512-VNNI, AVX-VNNI, AMX): --int8 is refused here "
                "(torch's int8 matmul falls back to a kernel far slower than fp32)",
                "predict and serve in fp32 on this CPU",
            )
        )
    return findings


def check_packages(facts: Facts, backend: str) -> list[Finding]:
    versions = ", ".join(f"{k} {v}" for k, v in facts.packages.items() if v and k != "bitsandbytes")
    findings = [Finding("ok", "packages", f"python {facts.python}, {versions}")]
    bnb = facts.packages.get("bitsandbytes")
    if backend in ("cuda", "rocm"):
        findings.append(
            Finding(
                "ok" if bnb else "warn",
                "qlora",
                f"bitsandbytes {bnb}: 4-bit loading can be tried (the smoke test checks a 4-bit linear)"
                if bnb
                else "bitsandbytes is not installed: no 4-bit QLoRA; LoRA in bf16 works",
                "" if bnb else "pip install bitsandbytes (on ROCm, a release that lists ROCm support)",
            )
        )
    return findings


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
