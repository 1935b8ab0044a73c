"""The CPU's instructions: which CPUs run int8 at speed, and the warning when bf16 would be emulated."""

from loracls.environment import cpu


def test_bf16_is_said_to_be_emulated_only_on_a_cpu_without_it():
    assert "emulated" in cpu.emulated_bf16_warning("bf16", "cpu", flags={"avx2", "fma"})
    assert cpu.emulated_bf16_warning("bf16", "cpu", flags={"avx512_bf16"}) is None
    assert cpu.emulated_bf16_warning("auto", "cpu", flags={"avx2"}) is None
    assert cpu.emulated_bf16_warning("bf16", "cuda", flags={"avx2"}) is None


def test_which_cpus_run_int8():
    assert not cpu.cpu_has_fast_int8({"avx2", "fma", "avx512f", "avx512bw"}, "x86_64")
    assert cpu.cpu_has_fast_int8({"avx2", "avx_vnni"}, "x86_64")
    assert cpu.cpu_has_fast_int8({"avx512f", "avx512_vnni"}, "x86_64")
    assert cpu.cpu_has_fast_int8({"amx_int8", "amx_tile"}, "AMD64")
    assert cpu.cpu_has_fast_int8(set(), "aarch64")  # not measured there: not refused
