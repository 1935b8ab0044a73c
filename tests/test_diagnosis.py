"""Verdicts on recorded machines: `diagnose` on the facts of tests/doctor_machines.py, no smoke test run."""

import dataclasses

import pytest

from loracls.environment.diagnosis import Facts, diagnose
from tests.doctor_machines import MACHINES


def with_env(name: str, **env) -> Facts:
    return dataclasses.replace(MACHINES[name], env=env)


def levels(report) -> dict[str, str]:
    return {f.topic: f.level for f in report.findings}


def test_mi210_needs_no_override_and_a_wrong_one_is_flagged():
    report = diagnose(MACHINES["mi210"])
    assert report.backend == "rocm" and report.can_train
    arch = next(f for f in report.findings if f.topic == "arch")
    assert "gfx90a" in arch.message and "no override needed" in arch.message
    assert not any("HSA_OVERRIDE_GFX_VERSION=" in f.advice for f in report.findings)
    rocm = next(f for f in report.findings if f.topic == "rocm")
    assert rocm.level == "ok" and "HIP underneath" in rocm.message and "6.2.4" in rocm.message
    # the seed write-up's advice: forcing an MI210 to gfx908 (MI100) kernels
    forced = diagnose(with_env("mi210", HSA_OVERRIDE_GFX_VERSION="9.0.8"))
    override = next(f for f in forced.findings if f.topic == "override")
    assert override.level == "warn" and "unset HSA_OVERRIDE_GFX_VERSION" in override.advice
    assert "gfx908 kernels on a gfx90a" in override.advice


def test_mi300x_with_misaligned_rocm_releases_is_warned():
    report = diagnose(MACHINES["mi300x"])
    rocm = next(f for f in report.findings if f.topic == "rocm")
    assert rocm.level == "warn" and "ROCm 6.2" in rocm.message and "6.3.1" in rocm.message
    assert "whl/rocm6.3" in rocm.advice
    assert levels(report)["arch"] == "ok" and report.can_train


def test_rx7900xtx_is_supported_as_built():
    report = diagnose(MACHINES["rx7900xtx"])
    assert report.can_train and levels(report) == {
        "rocm": "ok",
        "arch": "ok",
        "packages": "ok",
        "qlora": "warn",
    }


@pytest.mark.parametrize(
    ("machine", "value", "sibling"), [("rx6700xt", "10.3.0", "gfx1030"), ("radeon780m", "11.0.0", "gfx1100")]
)
def test_missing_rdna_architectures_get_the_family_override(machine, value, sibling):
    report = diagnose(MACHINES[machine])
    assert not report.can_train
    arch = next(f for f in report.findings if f.topic == "arch")
    assert arch.level == "error" and "not in this torch build" in arch.message
    assert arch.advice.startswith(f"export HSA_OVERRIDE_GFX_VERSION={value}") and sibling in arch.advice
    fixed = diagnose(with_env(machine, HSA_OVERRIDE_GFX_VERSION=value))
    assert fixed.can_train and f"runs as {sibling}" in fixed.findings[1].message


def test_override_across_a_major_version_or_malformed_is_an_error():
    crossing = diagnose(with_env("radeon780m", HSA_OVERRIDE_GFX_VERSION="10.3.0"))
    finding = next(f for f in crossing.findings if f.topic == "override")
    assert (
        finding.level == "error"
        and "crosses a major version" in finding.message
        and "11.0.0" in finding.advice
    )
    malformed = diagnose(with_env("rx6700xt", HSA_OVERRIDE_GFX_VERSION="9.0.a"))
    assert "malformed" in malformed.findings[1].message and "9.0.10" in malformed.findings[1].advice


def test_mixed_gpus_get_the_per_device_override():
    report = diagnose(MACHINES["mixed"])
    first, second = [f for f in report.findings if f.topic == "arch"]
    assert first.level == "ok" and second.level == "error"
    assert "HSA_OVERRIDE_GFX_VERSION_1=10.3.0 (ROCm 6.2+)" in second.advice
    assert diagnose(with_env("mixed", HSA_OVERRIDE_GFX_VERSION_1="10.3.0")).can_train


def test_architecture_without_a_sibling_gets_no_override():
    report = diagnose(MACHINES["mi50_on_rocm64"])
    arch = next(f for f in report.findings if f.topic == "arch")
    assert arch.level == "error" and "no ISA-compatible sibling" in arch.message
    assert "HSA_OVERRIDE_GFX_VERSION=" not in arch.advice


def test_nvidia_machines():
    h100 = diagnose(MACHINES["h100"])
    assert h100.backend == "cuda" and h100.can_train and "550.90.07" in h100.findings[0].message
    assert levels(h100)["qlora"] == "ok"
    blackwell = diagnose(MACHINES["rtx5090_old_wheel"])
    arch = next(f for f in blackwell.findings if f.topic == "arch")
    assert not blackwell.can_train and "no kernels for sm_120" in arch.message


def test_cpu_machines():
    cpu = diagnose(MACHINES["cpu"])
    assert cpu.backend == "cpu" and cpu.can_train and "qlora" not in levels(cpu)
    avx2, bf16 = diagnose(MACHINES["cpu_avx2"]), diagnose(MACHINES["cpu_avx512_bf16"])
    assert avx2.can_train and "in fp32 (no AVX-512-BF16 or AMX" in avx2.findings[0].message
    assert levels(avx2)["int8"] == "warn" and "--int8 is refused" in avx2.findings[1].message
    assert "in bf16 (AVX-512-BF16" in bf16.findings[0].message and "int8" not in levels(bf16)
    hidden = diagnose(MACHINES["cpu_wheel_on_mi210"])
    assert not hidden.can_train
    assert "rocminfo sees gfx90a but torch sees no GPU" in hidden.findings[0].message
    assert "download.pytorch.org/whl/rocm6.2" in hidden.findings[0].advice
