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


def reads_texts(info: dict) -> str:
    """How an export reads a text, for its users: inside the run's prompt that its tokenizer adds, or not."""
    prompt = info.get("prompt")
    if not prompt:
        return "it reads each text as it is (no prompt)"
    shown = f"{shortened(prompt['prefix'])} + text + {shortened(prompt['suffix'])}"
    if info.get("tokenizer_adds_prompt"):
        return (
            f"its tokenizer puts the run's prompt around every text ({shown}): give it raw texts, in "
            "transformers' pipeline, vLLM or loracls predict alike"
        )
    return f"note: its tokenizer is a slow one and cannot add the prompt; tokenize {shown} yourself"


def shortened(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else "..." + text[-width:])


def named_paths(args: list[str]) -> dict[str, Path]:
    """`loracls serve`'s folders (runs or exports) by the name requests use: `NAME=PATH`, or a folder's own
    name; refused when two share a name or one is neither a run nor an export."""
    paths: dict[str, Path] = {}
    for arg in args:
        name, _, folder = arg.rpartition("=") if "=" in arg else ("", "", arg)
        path = Path(folder)
        name = name or path.resolve().name
        if name in paths:
            raise LoraclsError(f"two classifiers are named {name!r}; name them apart with NAME=PATH")
        folder_kind(path)
        paths[name] = path
    return paths
