"""Devices: what `--precision auto` picks, where inference runs, what the launch configuration offloads."""

from types import SimpleNamespace

import pytest
import torch

from loracls.environment import devices


def test_auto_precision_uses_bf16_only_on_cpus_that_compute_it():
    assert devices.mixed_precision("auto", "cpu", flags={"avx2", "fma"}) == "no"
    assert devices.mixed_precision("auto", "cpu", flags={"avx512f", "avx512_bf16"}) == "bf16"
    assert devices.mixed_precision("auto", "cpu", flags={"amx_bf16", "amx_tile"}) == "bf16"
    assert devices.mixed_precision("fp32", "cpu", flags={"avx512_bf16"}) == "no"
    assert devices.mixed_precision("bf16", "cpu", flags=set()) == "bf16"


@pytest.mark.parametrize(
    ("hip", "arch", "major", "expected"),
    [
        (None, "", 9, "bf16"),  # H100
        (None, "", 8, "bf16"),  # A100
        (None, "", 7, "fp16"),  # V100, T4: bf16 only emulated, which is_bf16_supported() counts
        ("6.4", "gfx90a:sramecc+:xnack-", 9, "bf16"),  # MI210/MI250
        ("6.4", "gfx942:sramecc+:xnack-", 9, "bf16"),  # MI300
        ("6.4", "gfx1100", 11, "bf16"),  # RX 7900
        ("6.4", "gfx906:sramecc+:xnack-", 9, "fp16"),  # MI50: no bf16 units (torch says yes)
        ("6.4", "gfx1030", 10, "fp16"),  # RX 6800
    ],
)
def test_auto_precision_on_a_gpu_is_bf16_only_where_it_is_computed_in_hardware(
    monkeypatch, hip, arch, major, expected
):
    props = SimpleNamespace(major=major, gcnArchName=arch)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # what torch answers there
    assert devices.mixed_precision("auto", "cuda") == expected
    assert devices.mixed_precision("fp32", "cuda") == "no"


def test_offload_is_named_from_the_launch_configuration():
    offload = SimpleNamespace(offload_params=True)
    fsdp = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(cpu_offload=offload)))
    assert "FSDP" in devices.offload_in_use(fsdp)
    zero = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    deepspeed = SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=zero))
    )
    assert devices.offload_in_use(deepspeed) == "DeepSpeed offload_optimizer to cpu"
    assert devices.offload_in_use(SimpleNamespace(state=SimpleNamespace())) is None


def test_inference_runs_on_cuda_then_mps_then_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert devices.inference_device() == torch.device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert devices.inference_device() == torch.device("cpu")
