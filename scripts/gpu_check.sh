#!/usr/bin/env bash
# Run on a GPU machine (ROCm or CUDA) after installing loracls: prints everything needed to judge the stack.
#   bash scripts/gpu_check.sh [MODEL]      (MODEL for the memory estimate; default gemma3-270m)
set -uo pipefail
model="${1:-gemma3-270m}"
echo "== loracls doctor (human) =="
loracls doctor --model "$model"
status=$?
echo "== loracls doctor --json =="
loracls doctor --json --model "$model"
echo "== tools =="
for tool in "rocminfo" "amd-smi version" "rocm-smi --showdriverversion" "nvidia-smi"; do
  if command -v "${tool%% *}" >/dev/null; then echo "-- $tool"; $tool 2>&1 | head -40; fi
done
cat /opt/rocm/.info/version 2>/dev/null
env | grep -E '^(HSA_OVERRIDE_GFX_VERSION|HIP_VISIBLE_DEVICES|ROCR_VISIBLE_DEVICES|CUDA_VISIBLE_DEVICES)' || true
python -c "import torch; print('torch', torch.__version__, 'hip', torch.version.hip, 'cuda', torch.version.cuda, 'archs', torch.cuda.get_arch_list() if torch.cuda.is_available() else [])"
echo "doctor exit code: $status (0: can train)"
exit $status
