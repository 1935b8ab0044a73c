"""`loracls doctor`'s verdicts: can this GPU stack (ROCm, CUDA) or CPU train, and if not, what to change.

Every verdict is a pure function of the machine's `Facts` (`diagnose`), so the decisions are tested on
recorded outputs of MI210, MI300X, Radeon and NVIDIA machines; `doctor.collect_facts` reads this machine's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from loracls.environment.cpu import cpu_has_fast_bf16, cpu_has_fast_int8
from loracls.environment.rocm import ISA_FAMILIES, base_arch, gfx_from_hsa, hsa_version, major_minor


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
            findings.append(built_arch_finding(label, gfx, override))
        elif override:
            findings.append(override_finding(label, gfx, override, built))
        else:
            findings.append(missing_arch_finding(label, gfx, built, index, mixed=len(set(archs)) > 1))
    return findings


def isa_sibling(gfx: str, built: set[str]) -> str | None:
    """An architecture in the build with the same ISA as `gfx` (whose kernels run on it), if any."""
    return next((base for base, members in ISA_FAMILIES.items() if gfx in members and base in built), None)


def built_arch_finding(label: str, gfx: str, override: str | None) -> Finding:
    """A GPU whose architecture the wheel has kernels for: an override would only do harm."""
    if override:
        return Finding(
            "warn",
            "override",
            f"{label}: HSA_OVERRIDE_GFX_VERSION={override} is set, but {gfx} is in this torch "
            "build and needs no override",
            f"unset HSA_OVERRIDE_GFX_VERSION: it makes the runtime load {gfx_from_hsa(override)} "
            f"kernels on a {gfx}, which can fault or compute wrong results",
        )
    return Finding("ok", "arch", f"{label}: in this torch build; no override needed")


def override_finding(label: str, gfx: str, override: str, built: set[str]) -> Finding:
    """A GPU missing from the build, run through HSA_OVERRIDE_GFX_VERSION: does the override land on kernels
    the build has, of the same generation?"""
    target = gfx_from_hsa(override)
    if target is None:
        return Finding(
            "error",
            "override",
            f"HSA_OVERRIDE_GFX_VERSION={override} is malformed",
            "use decimal major.minor.stepping, e.g. 10.3.0 (gfx90a would be 9.0.10)",
        )
    if hsa_version(target).split(".")[0] != hsa_version(gfx).split(".")[0]:
        sibling = isa_sibling(gfx, built)
        return Finding(
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
    if target in built:
        return Finding(
            "ok",
            "override",
            f"{label}: not in this build; runs as {target} through HSA_OVERRIDE_GFX_VERSION={override}",
        )
    return Finding(
        "error",
        "override",
        f"{label}: HSA_OVERRIDE_GFX_VERSION={override} names {target}, "
        "which this torch build does not contain either",
        f"built: {', '.join(sorted(built))}",
    )


def missing_arch_finding(label: str, gfx: str, built: set[str], index: int, mixed: bool) -> Finding:
    """A GPU missing from the build, with no override: the override that would run it, if one would.

    `mixed` (GPUs of different architectures in one machine) asks for the per-device override."""
    sibling = isa_sibling(gfx, built)
    if sibling is None:
        return Finding(
            "error",
            "arch",
            f"{label}: {gfx} is not in this torch build (built: {', '.join(sorted(built))}) and "
            "has no ISA-compatible sibling there",
            "install a torch wheel for a newer ROCm release that lists this architecture; an "
            "override to another family would compute wrong results or fault",
        )
    return Finding(
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
