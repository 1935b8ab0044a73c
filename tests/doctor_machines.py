"""Facts of real machine types for `loracls doctor`, as the tools would print them.

The rocminfo text is **generated from a template** (`agent()` below) that follows the layout of ROCm 6.x's
output (a CPU agent, then one agent block per GPU with `Name`, `Marketing Name`, `Device Type` and an `ISA
Info` section naming e.g. `amdgcn-amd-amdhsa--gfx90a:sramecc+:xnack-`), not captured from a machine; real
outputs carry more fields per agent, which the parser skips. Torch arch lists are those of the official
wheels (`torch.cuda.get_arch_list()`).
"""

from loracls.environment.diagnosis import Device, Facts

ROCM62_ARCHS = ["gfx900", "gfx906", "gfx908", "gfx90a", "gfx942", "gfx1030", "gfx1100", "gfx1101", "gfx1102"]
ROCM64_ARCHS = [
    "gfx908",
    "gfx90a",
    "gfx942",
    "gfx950",
    "gfx1030",
    "gfx1100",
    "gfx1101",
    "gfx1102",
    "gfx1200",
    "gfx1201",
]
CUDA124_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
PACKAGES = {"transformers": "5.24.0", "peft": "0.21.2", "accelerate": "1.15.0", "bitsandbytes": None}


def agent(number: int, name: str, marketing: str, device_type: str, isa: str = "") -> str:
    text = f"""*******
Agent {number}
*******
  Name:                    {name}
  Uuid:                    {"CPU-XX" if device_type == "CPU" else "GPU-5e2c1a7b3d9f0c11"}
  Marketing Name:          {marketing}
  Vendor Name:             {"CPU" if device_type == "CPU" else "AMD"}
  Feature:                 {"None specified" if device_type == "CPU" else "KERNEL_DISPATCH"}
  Profile:                 {"FULL_PROFILE" if device_type == "CPU" else "BASE_PROFILE"}
  Float Round Mode:        NEAR
  Max Queue Number:        {"0(0x0)" if device_type == "CPU" else "128(0x80)"}
  Queue Min Size:          {"0(0x0)" if device_type == "CPU" else "64(0x40)"}
  Queue Max Size:          {"0(0x0)" if device_type == "CPU" else "131072(0x20000)"}
  Queue Type:              MULTI
  Node:                    {number - 1}
  Device Type:             {device_type}
  Cache Info:
    L1:                      {"32768(0x8000) KB" if device_type == "CPU" else "16(0x10) KB"}
  Chip ID:                 {"0(0x0)" if device_type == "CPU" else "29711(0x740f)"}
  Compute Unit:            {"64" if device_type == "CPU" else "104"}
"""
    if isa:
        text += f"""  ISA Info:
    ISA 1
      Name:                    amdgcn-amd-amdhsa--{isa}
      Machine Models:          HSA_MACHINE_MODEL_LARGE
      Profiles:                HSA_PROFILE_BASE
"""
    return text


def rocminfo(driver: str, gpus: list[tuple[str, str, str]]) -> str:
    """`rocminfo` with a CPU agent and the given (gfx, marketing name, full ISA name) GPU agents."""
    header = f"""ROCk module version {driver} is loaded
=====================
HSA System Attributes
=====================
Runtime Version:         1.14
Runtime Ext Version:     1.6
System Timestamp Freq.:  1000.000000MHz
Machine Model:           LARGE
System Endianness:       LITTLE
Mwaitx:                  DISABLED
DMAbuf Support:          YES

==========
HSA Agents
==========
"""
    agents = [agent(1, "AMD EPYC 7763 64-Core Processor", "AMD EPYC 7763 64-Core Processor", "CPU")]
    agents += [agent(i + 2, gfx, name, "GPU", isa) for i, (gfx, name, isa) in enumerate(gpus)]
    return header + "".join(agents) + "*** Done ***\n"


AMD_SMI_VERSION = "AMDSMI Tool: 24.6.3+9578815 | AMDSMI Library version: 24.6.3.0 | ROCm version: 6.2.4\n"
ROCM_SMI_DRIVER = """

============================ ROCm System Management Interface ============================
================================ Version of System Component =============================
Driver version: 6.8.5
==========================================================================================
================================== End of ROCm SMI Log ===================================
"""


def rocm_machine(
    torch_hip: str, system: str, driver: str, gpus: list[tuple[str, str, float]], archs, env=None
):
    """Facts of a ROCm machine with GPUs given as (gcnArchName, marketing name, memory GB)."""
    return Facts(
        python="3.11.9",
        torch=f"2.6.0+rocm{torch_hip[:3]}",
        torch_hip=torch_hip,
        torch_cuda=None,
        arch_list=archs,
        devices=[Device(name, memory, arch) for arch, name, memory in gpus],
        env=env or {},
        packages=PACKAGES,
        system_rocm=system,
        driver=driver,
        rocminfo_gpus=[arch.split(":")[0] for arch, _, _ in gpus],
    )


def cuda_machine(name: str, memory: float, arch: str, driver: str, bitsandbytes: str | None = None) -> Facts:
    """Facts of a machine with one NVIDIA GPU and the official cu124 wheel."""
    return Facts(
        python="3.11.9",
        torch="2.5.1+cu124",
        torch_hip=None,
        torch_cuda="12.4",
        arch_list=CUDA124_ARCHS,
        devices=[Device(name, memory, arch)],
        env={},
        packages={**PACKAGES, "bitsandbytes": bitsandbytes},
        driver=driver,
    )


def cpu_machine(**extra) -> Facts:
    """Facts of a machine where torch (a CPU wheel) sees no GPU; `extra` adds what the ROCm tools report."""
    return Facts(
        python="3.11.7",
        torch="2.13.0+cpu",
        torch_hip=None,
        torch_cuda=None,
        arch_list=[],
        devices=[],
        env={},
        packages=PACKAGES,
        **extra,
    )


MACHINES = {
    "mi210": rocm_machine(
        "6.2.41133-dd7f95766",
        "6.2.4-120",
        "6.8.5",
        [("gfx90a:sramecc+:xnack-", "AMD Instinct MI210", 64.0)],
        ROCM62_ARCHS,
    ),
    "mi300x": rocm_machine(
        "6.2.41134-65d174c3e",
        "6.3.1-48",
        "6.10.5",
        [("gfx942:sramecc+:xnack-", "AMD Instinct MI300X", 192.0)],
        ROCM62_ARCHS,
    ),
    "rx7900xtx": rocm_machine(
        "6.4.43482-0f2d60242", "6.4.1", "6.12.12", [("gfx1100", "AMD Radeon RX 7900 XTX", 24.0)], ROCM64_ARCHS
    ),
    "rx6700xt": rocm_machine(
        "6.2.41133-dd7f95766", "6.2.4", "6.8.5", [("gfx1031", "AMD Radeon RX 6700 XT", 12.0)], ROCM62_ARCHS
    ),
    "radeon780m": rocm_machine(
        "6.2.41133-dd7f95766", "6.2.4", "6.8.5", [("gfx1103", "AMD Radeon 780M", 16.0)], ROCM62_ARCHS
    ),
    "mixed": rocm_machine(
        "6.2.41133-dd7f95766",
        "6.2.4",
        "6.8.5",
        [("gfx1100", "AMD Radeon RX 7900 XTX", 24.0), ("gfx1031", "AMD Radeon RX 6700 XT", 12.0)],
        ROCM62_ARCHS,
    ),
    "mi50_on_rocm64": rocm_machine(
        "6.4.43482-0f2d60242",
        "6.4.1",
        "6.12.12",
        [("gfx906:sramecc+:xnack-", "AMD Instinct MI50", 16.0)],
        ROCM64_ARCHS,
    ),
    "h100": cuda_machine("NVIDIA H100 80GB HBM3", 79.1, "sm_90", "550.90.07", bitsandbytes="0.45.0"),
    "rtx5090_old_wheel": cuda_machine("NVIDIA GeForce RTX 5090", 31.4, "sm_120", "570.86.10"),
    "cpu": cpu_machine(),
    "cpu_avx2": cpu_machine(cpu_flags=["avx2"], cpu_machine="x86_64"),
    "cpu_avx512_bf16": cpu_machine(
        cpu_flags=["avx2", "avx512_bf16", "avx512_vnni", "avx512f"], cpu_machine="x86_64"
    ),
    "cpu_wheel_on_mi210": cpu_machine(system_rocm="6.2.4-120", driver="6.8.5", rocminfo_gpus=["gfx90a"]),
}

ROCMINFO = {
    "mi210": rocminfo("6.8.5", [("gfx90a", "AMD Instinct MI210", "gfx90a:sramecc+:xnack-")]),
    "mixed": rocminfo(
        "6.8.5",
        [("gfx1100", "AMD Radeon RX 7900 XTX", "gfx1100"), ("gfx1031", "AMD Radeon RX 6700 XT", "gfx1031")],
    ),
}
