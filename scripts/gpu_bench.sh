#!/usr/bin/env bash
# For a GPU machine (CUDA or ROCm): the three benchmarks of benchmarks/README.md with the GPU's settings
# (precision auto = bf16 where supported, more steps, larger batches for the peak and MFU), writing
# benchmarks/results/{train_throughput,mfu,inference}_cuda.json beside the CPU results (and copies to $OUT
# when set). Needs the repository installed (make install, with the GPU's torch wheel first).
#   bash scripts/gpu_bench.sh
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
$PY benchmarks/train_throughput.py --steps 150 --eval 500 --precision auto 2>&1 | tail -12
$PY benchmarks/mfu.py --steps 100 --batch-size 64 --precision auto 2>&1 | tail -6
$PY benchmarks/inference.py --texts 2000 2>&1 | tail -6
if [ -n "${OUT:-}" ]; then cp benchmarks/results/*_cuda.json "$OUT"/; fi
