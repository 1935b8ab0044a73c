"""What loracls knows about ROCm and AMD GPUs, as data and pure functions: which architectures run a sibling's
kernels under `HSA_OVERRIDE_GFX_VERSION`, how a gfx name maps to that variable's value, and how to read
`rocminfo`, `rocm-smi` and `amd-smi` output. `doctor` turns these into verdicts.
"""

from __future__ import annotations

import re

ISA_FAMILIES = {
    "gfx1030": ("gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035", "gfx1036"),
    "gfx1100": ("gfx1101", "gfx1102", "gfx1103"),
}
"""Architectures that run the kernels of a sibling in the same ISA family when told to with
`HSA_OVERRIDE_GFX_VERSION` (the community-tested RDNA 2 and RDNA 3 cases)."""


ROCM_VERSION_FILES = ("/opt/rocm/.info/version", "/opt/rocm/.info/version-dev")


def base_arch(arch: str) -> str:
    """`gfx90a:sramecc+:xnack-` -> `gfx90a`."""
    return arch.split(":", 1)[0].strip()


def hsa_version(gfx: str) -> str:
    """The `HSA_OVERRIDE_GFX_VERSION` value of an architecture: decimal major.minor.stepping.

    The last two characters of the gfx name are hexadecimal minor and stepping digits: gfx90a is 9.0.10
    (not 9.0.a), gfx1031 is 10.3.1, gfx942 is 9.4.2.
    """
    digits = base_arch(gfx).removeprefix("gfx")
    if len(digits) < 3:
        raise ValueError(f"not a gfx architecture: {gfx}")
    return f"{int(digits[:-2])}.{int(digits[-2], 16)}.{int(digits[-1], 16)}"


def gfx_from_hsa(version: str) -> str | None:
    """`10.3.0` -> `gfx1030`; None when the value is malformed."""
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", version.strip())
    if not match:
        return None
    major, minor, stepping = (int(x) for x in match.groups())
    return f"gfx{major}{minor:x}{stepping:x}"


def major_minor(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def parse_rocminfo(text: str) -> tuple[list[str], str | None]:
    """(gfx names of the GPU agents, amdgpu driver version) from `rocminfo` output."""
    driver = re.search(r"ROCk module version\s+(\S+)", text)
    gpus = []
    for agent in re.split(r"\*{5,}\s*\n\s*Agent \d+", text)[1:]:
        if re.search(r"Device Type:\s+GPU", agent):
            name = re.search(r"^\s*Name:\s+(gfx[0-9a-f]+)", agent, re.MULTILINE)
            if name:
                gpus.append(name.group(1))
    return gpus, driver.group(1) if driver else None


def parse_driver_version(text: str) -> str | None:
    """`rocm-smi --showdriverversion` / `nvidia-smi` style "Driver version: X"."""
    match = re.search(r"Driver [Vv]ersion:?\s+(\S+)", text)
    return match.group(1) if match else None


def parse_amd_smi_version(text: str) -> str | None:
    """The ROCm release in `amd-smi version` output ("... | ROCm version: 6.2.4")."""
    match = re.search(r"ROCm version:\s*(\d+\.\d+(?:\.\d+)?)", text)
    return match.group(1) if match else None
