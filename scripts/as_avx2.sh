#!/usr/bin/env bash
# Run a command as on a CPU with AVX2 and nothing newer (what CI machines may be), on a machine that has
# AVX-512/AMX: oneDNN and ATen capped at AVX2, and /proc/cpuinfo without the avx512*/amx*/avx_vnni flags (for
# loracls' own checks and inductor's). Needs root (a private mount namespace). Under this cap oneDNN's int8
# products are not exact, so the three int8 tests fail; they pass on AVX2 hardware (docs/contributing.md).
# Inductor's kernels go to a cache of their own: torch 2.13 keys its cache without the capability, and a
# kernel cached here under ATEN_CPU_CAPABILITY=avx2 aborted a later uncapped run that loaded it.
#   scripts/as_avx2.sh .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=0
set -euo pipefail
capped=$(mktemp)
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_avx2}"
sed -E 's/ (avx512[a-z_0-9]*|amx[a-z_0-9]*|avx_vnni[a-z_0-9]*)//g' /proc/cpuinfo > "$capped"
exec unshare -m bash -c 'mount --bind "$0" /proc/cpuinfo && ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 CI=true exec "$@"' "$capped" "$@"
