#!/usr/bin/env bash
# On a machine with PyPI: fetch the wheels that a locked-down GPU box lacks for scripts/gpu_check.py into .whl/
# (git-ignored; under 1 MB). Carry .whl/ to the box with the tree. Not pyarrow, even where the box's is older:
# unpacked outside site-packages, dill (datasets' fingerprint) pickles it by value and fails ("Can't pickle
# <class 'MonthDayNano'>", seen on an H200 box, 2026-12-04); datasets 5.2 needs pyarrow >= 24, the box had 25.
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]     (the box's python, default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
rm -rf .whl && mkdir .whl
python3 -m pip download --quiet --only-binary=:all: --no-deps --dest .whl --python-version "$version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 datasets dill multiprocess
du -sh .whl && ls .whl
