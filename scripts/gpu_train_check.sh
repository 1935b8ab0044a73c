#!/usr/bin/env bash
# For a GPU machine (CUDA or ROCm): a short bf16 LoRA run and a short 4-bit QLoRA run of the embedded Gemma 3
# 270M on the built-in reviews; prints throughput and peak memory of each and writes them to $OUT (default
# gpu-check/) as JSON. Needs the repository installed (make install, with the GPU's torch wheel first).
set -euo pipefail
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
L=${LORACLS:-.venv/bin/loracls}
COMMON="--data zh-reviews --max-train-examples 2000 --max-eval-examples 500 --max-length 128 --epochs 1
        --batch-size 32 --eval-every 1000 --log-every 10 --no-baseline"
$L doctor --json --model gemma3-270m > "$OUT/doctor.json" || true
$L train $COMMON --precision bf16 --out "$OUT/bf16" 2>&1 | tail -25
pip install -q bitsandbytes || true
$L train $COMMON --precision bf16 --quantize 4bit --out "$OUT/qlora" 2>&1 | tail -25 || true
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = {}
for name in ("bf16", "qlora"):
    metrics = out / name / "metrics.json"
    if not metrics.is_file():
        summary[name] = {"finished": False, "status": json.loads((out / name / "status.json").read_text()) if (out / name / "status.json").is_file() else None}
        continue
    m = json.loads(metrics.read_text())
    log = [json.loads(line) for line in (out / name / "train_log.jsonl").read_text().splitlines()]
    peak = max((r.get("mem_allocated_gb", 0) for r in log if r["kind"] == "train"), default=None)
    summary[name] = {"finished": True, "test_accuracy": m["test"]["accuracy"], "examples_per_s": m["train"]["examples_per_s"],
                     "tokens_per_s": m["train"]["tokens_per_s"], "peak_allocated_gb": peak}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PY
