"""The export folder's own files, as `export_run` writes them and `predict`, `serve` and the CLI read them:
kept apart from `export.py` (which needs `Classifier`) so that readers of the format need no exporter."""

from __future__ import annotations

import json
from pathlib import Path

EXPORT_INFO = "loracls.json"
"""Written into every export: labels, max_length, text column, the base model and whether LoRA is merged."""
INT8_RANGES = "int8_ranges.safetensors"
"""Written by `export --int8`: the calibrated input ranges `loracls.int8.quantize` smooths with."""


def read_export_info(folder: Path) -> dict:
    """An export's `loracls.json`, as `export_run` wrote it."""
    return json.loads((Path(folder) / EXPORT_INFO).read_text(encoding="utf-8"))
