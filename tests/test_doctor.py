"""`loracls doctor`: the facts it collects, the child-process smoke test, the command and its checkup."""

import json

import pytest
from rich.console import Console

from loracls.environment import doctor
from loracls.environment.doctor import smoke_test
from tests.conftest import invoke
from tests.doctor_machines import MACHINES


def test_smoke_test_runs_real_kernels_in_a_child_on_the_cpu():
    result = smoke_test("cpu", MACHINES["cpu"])
    assert result.ok, result.diagnosis
    assert result.details["matmul_max_error"] < 1e-3 and result.details["attention_backward_finite"]
    assert result.details["float32_tflops"] > 0 and "bfloat16_tflops" in result.details


def test_a_child_killed_by_a_signal_becomes_a_diagnosis():
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    result = smoke_test("cuda", MACHINES["rx6700xt"], code=crash)
    assert not result.ok and result.details == {"signal": "SIGSEGV"}
    assert "crashed the process (SIGSEGV)" in result.diagnosis
    assert "HSA_OVERRIDE_GFX_VERSION=10.3.0" in result.diagnosis


def test_a_kernel_error_and_a_hang_become_diagnoses():
    fault = (
        "import sys; sys.stderr.write('Memory access fault by GPU node-2 on address 0x7f\\n'); sys.exit(134)"
    )
    result = smoke_test("cuda", MACHINES["mi210"], code=fault)
    assert not result.ok and result.diagnosis.startswith(
        "the GPU kernel crashed on cuda: Memory access fault"
    )
    assert "gfx90a is in this torch build" in result.diagnosis  # no override to blame: look at the driver
    hang = smoke_test("cuda", MACHINES["mi210"], timeout=1, code="import time; time.sleep(30)")
    assert not hang.ok and "hung for 1 s" in hang.diagnosis


def test_doctor_command_on_this_machine(monkeypatch):
    result = invoke("doctor", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["can_train"] and payload["smoke_test"]["ok"] and payload["facts"]["torch"]
    assert payload["memory"]["free_gb"]["cpu"] > 0

    monkeypatch.setattr(doctor, "collect_facts", lambda: MACHINES["rx6700xt"])
    result = invoke("doctor", "--no-smoke")
    assert result.exit_code == 1
    assert "HSA_OVERRIDE_GFX_VERSION=10.3.0" in result.output and "cannot train" in result.output


def test_checkup_gives_the_doctor_commands_payload_and_text(monkeypatch):
    monkeypatch.setattr(doctor, "collect_facts", lambda: MACHINES["mi210"])
    crashed = doctor.SmokeResult(False, {"float32_tflops": 1.5}, "it crashed")
    monkeypatch.setattr(doctor, "smoke_test", lambda device, facts: crashed)
    found = doctor.checkup()
    assert found.device == "cuda" and found.report.can_train and not found.can_train  # the kernels failed
    payload = found.to_json()
    assert payload["backend"] == "rocm" and payload["can_train"] is False
    assert payload["smoke_test"]["diagnosis"] == "it crashed" and payload["facts"]["devices"][0]["arch"]
    found.memory["free_gb"] = {"cuda:0": 60.0}
    console = Console(record=True, width=300)
    doctor.print_checkup(found, console)
    text = console.export_text()
    assert "error smoke test: it crashed" in text and "memory free: {'cuda:0': 60.0}" in text
    assert text.rstrip().endswith("cannot train as it is")
    assert doctor.checkup(smoke=False).can_train


def test_training_on_a_gpu_stops_early_when_the_smoke_test_fails(monkeypatch):
    from loracls.errors import LoraclsError

    monkeypatch.setattr(
        doctor, "smoke_test", lambda device, facts: doctor.SmokeResult(False, {}, "it crashed")
    )
    with pytest.raises(LoraclsError, match="GPU smoke test failed: it crashed"):
        doctor.check_before_training("cuda:0", MACHINES["rx6700xt"])
