"""The export folder's own files, as `export_run` writes them and `predict`, `serve` and the CLI read them:
kept apart from `export.py` (which needs `Classifier`) so that readers of the format need no exporter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from loracls.errors import LoraclsError

EXPORT_INFO = "loracls.json"
"""Written into every export: labels, max_length, text column, the base model and whether LoRA is merged."""
INT8_RANGES = "int8_ranges.safetensors"
"""Written by `export --int8`: the calibrated input ranges `loracls.inference.int8.quantize` smooths with."""


def read_export_info(folder: Path) -> dict:
    """An export's `loracls.json`, as `export_run` wrote it."""
    return json.loads((Path(folder) / EXPORT_INFO).read_text(encoding="utf-8"))


def folder_kind(path: Path) -> Literal["run", "export"]:
    """What a model folder given to `predict`, `eval` or `serve` holds: a run (`RUN/status.json`) or an export
    (`EXPORT_INFO`); anything else is refused, with the one message all of them give."""
    if (Path(path) / "status.json").is_file():
        return "run"
    if (Path(path) / EXPORT_INFO).is_file():
        return "export"
    raise LoraclsError(f"{path} is neither a loracls run folder nor a loracls export folder")
