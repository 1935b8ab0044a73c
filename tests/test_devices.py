"""Devices: what `--precision auto` picks, where inference runs, what the launch configuration offloads."""

from types import SimpleNamespace

import torch

from loracls.environment import devices


def test_auto_precision_uses_bf16_only_on_cpus_that_compute_it():
    assert devices.mixed_precision("auto", "cpu", flags={"avx2", "fma"}) == "no"
    assert devices.mixed_precision("auto", "cpu", flags={"avx512f", "avx512_bf16"}) == "bf16"
    assert devices.mixed_precision("auto", "cpu", flags={"amx_bf16", "amx_tile"}) == "bf16"
    assert devices.mixed_precision("fp32", "cpu", flags={"avx512_bf16"}) == "no"
    assert devices.mixed_precision("bf16", "cpu", flags=set()) == "bf16"


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
