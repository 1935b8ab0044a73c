"""ROCm facts (`rocm.py`): gfx names and HSA override values, and the parsing of the ROCm tools' outputs."""

import pytest

from loracls.environment.rocm import (
    gfx_from_hsa,
    hsa_version,
    parse_amd_smi_version,
    parse_driver_version,
    parse_rocminfo,
)
from tests.doctor_machines import AMD_SMI_VERSION, ROCM_SMI_DRIVER, ROCMINFO


@pytest.mark.parametrize(
    ("gfx", "value"),
    [
        ("gfx90a", "9.0.10"),
        ("gfx90a:sramecc+:xnack-", "9.0.10"),
        ("gfx942", "9.4.2"),
        ("gfx908", "9.0.8"),
        ("gfx1030", "10.3.0"),
        ("gfx1031", "10.3.1"),
        ("gfx1100", "11.0.0"),
        ("gfx1103", "11.0.3"),
    ],
)
def test_hsa_override_values_are_decimal_major_minor_stepping(gfx, value):
    assert hsa_version(gfx) == value
    assert gfx_from_hsa(value) == gfx.split(":")[0]


def test_tool_outputs_are_parsed():
    assert parse_rocminfo(ROCMINFO["mi210"]) == (["gfx90a"], "6.8.5")  # the CPU agent is not a GPU
    assert parse_rocminfo(ROCMINFO["mixed"]) == (["gfx1100", "gfx1031"], "6.8.5")
    assert parse_rocminfo("") == ([], None)
    assert parse_amd_smi_version(AMD_SMI_VERSION) == "6.2.4"
    assert parse_driver_version(ROCM_SMI_DRIVER) == "6.8.5"
