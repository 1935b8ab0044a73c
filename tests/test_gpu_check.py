"""`scripts/gpu_check.py --cpu`: the GPU check's dry run, so that the script cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts/gpu_check.py"


def test_gpu_check_dry_run_records_every_check(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = result["checks"]
    expected = [
        "doctor",
        "train_bf16_probed",
        "train_fp32",
        "train_fp16_scaler_nan",
        "train_gradient_checkpointing",
        "train_lm_bf16_probed",
    ]
    expected += ["qlora_4bit", "inference", "baseline_on_device", "step_shapes", "mfu"]
    assert list(checks) == expected and result["all_ok"], {k: v.get("error") for k, v in checks.items()}
    assert result["mode"] == "cpu dry run" and result["machine"]["device"] == "cpu"
    assert checks["train_fp16_scaler_nan"]["skipped_steps"] == [3]  # the forced NaN micro-batch's step
    assert "needs a GPU" in checks["qlora_4bit"]["refused"]
    assert checks["train_fp32"]["mean_abs_loss_diff_vs_bf16"] < 0.01  # the same run in two precisions
    assert checks["inference"]["texts_per_s"] > 0 and checks["mfu"]["gemm_peak_tflops"] > 0
    shapes = checks["step_shapes"]
    assert set(shapes["steady_speed_over_fp32"]) == {"fp32", "bf16_autocast", "bf16_base"}
    assert shapes["ways"]["bf16_autocast_profile"]["top_ops"][0]["self_ms"] > 0
    assert len(result["src_sha256"]) == 64 and checks["train_fp32"]["steady_examples_per_s"] > 0
    for name in ("train_bf16_probed", "train_fp32", "train_lm_bf16_probed"):
        assert len(checks[name]["losses"]) >= 4 and checks[name]["train"]["examples_per_s"] > 0
