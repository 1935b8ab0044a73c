#!/usr/bin/env bash
# For a GPU machine (CUDA or ROCm): the three benchmarks of benchmarks/README.md with the GPU's settings
# (precision auto = bf16 where supported, more steps, larger batches for the peak and MFU), writing
# benchmarks/results/{train_throughput,mfu,inference,precision,compile}_cuda.json beside the CPU results (and copies
# to $OUT when set). Needs the repository installed (make install, with the GPU's torch wheel first).
#   bash scripts/gpu_bench.sh
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
R=benchmarks/results
$PY benchmarks/train_throughput.py --steps 150 --eval 500 --precision auto 2>&1 | tail -12
$PY benchmarks/mfu.py --steps 100 --batch-size 64 --precision auto 2>&1 | tail -6
$PY benchmarks/inference.py --texts 2000 2>&1 | tail -6
# fp32 against bf16: the same run twice; validation accuracy must agree within noise
RUNS=$(mktemp -d)
for p in fp32 bf16; do
  $PY -m loracls train --data zh-reviews --max-train-examples 2000 --max-eval-examples 500 --max-length 128 \
    --epochs 1 --no-baseline --precision $p --out "$RUNS/$p" 2>&1 | tail -3
done
$PY - "$RUNS" "$R/precision_cuda.json" <<'PY'
import json, sys
from pathlib import Path
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
result = {}
for p in ("fp32", "bf16"):
    m = json.loads((runs / p / "metrics.json").read_text())
    result[p] = {"val_accuracy": m["best_val"]["accuracy"], "test_accuracy": m["test"]["accuracy"],
                 "examples_per_s": m["train"]["examples_per_s"], "micro_batch_size": m["train"]["micro_batch_size"]}
result["bf16/fp32 speed"] = result["bf16"]["examples_per_s"] / result["fp32"]["examples_per_s"]
out.write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps(result, indent=2))
PY
# last, as it may take a while to compile: does --compile help on the GPU?
$PY benchmarks/train_throughput.py --steps 150 --eval 500 --ways loracls,loracls-compile \
  --out "$R/compile_cuda.json" 2>&1 | tail -4
if [ -n "${OUT:-}" ]; then cp "$R"/*_cuda.json "$OUT"/; fi
