"""`predict`'s files: the texts of `--input`, and the results written back beside the input's own columns."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from loracls.data.tables import read_table
from loracls.errors import LoraclsError


def prediction_table(records: list[dict], inputs: pd.DataFrame | None = None, text_column: str = "text"):
    """`Classifier.predict`'s records as one row each (`text`, `label` or `labels`, `abstained`, `p_<label>`,
    `response`), after the input file's other columns (ids, metadata) so that results join back to it. A
    prediction column whose name the input already uses gets `_predicted`; the input's stay as they are.
    """
    rows = pd.DataFrame(
        [
            {
                "text": r["text"],
                **({"label": r["label"]} if "label" in r else {"labels": ",".join(map(str, r["labels"]))}),
                **({"abstained": r["abstained"]} if "abstained" in r else {}),
                **{f"p_{k}": v for k, v in r["probabilities"].items()},
                **({"response": r["response"]} if "response" in r else {}),
            }
            for r in records
        ]
    )
    if inputs is None:
        return rows
    kept = inputs.drop(columns=[text_column]).reset_index(drop=True)
    rows = rows.rename(columns={c: f"{c}_predicted" for c in rows.columns if c in kept.columns})
    return pd.concat([kept, rows], axis=1)


def read_texts(path: Path, column: str) -> tuple[pd.DataFrame, list[str]]:
    """`predict --input`: the file's rows and their texts (the other columns travel with the results)."""
    frame = read_table(path)
    if column not in frame.columns:
        raise LoraclsError(f"{path}: no text column '{column}'; columns: {list(frame.columns)}")
    return frame, [str(t) for t in frame[column]]


def write_predictions(
    path: Path, records: list[dict], inputs: pd.DataFrame | None = None, text_column: str = "text"
) -> None:
    """`--output`: a `.csv` of `prediction_table`'s rows, else JSON lines (each input row's other columns,
    then the record)."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        prediction_table(records, inputs, text_column).to_csv(path, index=False)
        return
    path.write_text("".join(line + "\n" for line in prediction_lines(records, inputs, text_column)), "utf-8")


def prediction_lines(records: list[dict], inputs: pd.DataFrame | None = None, text_column: str = "text"):
    """One JSON line per record, the input row's other columns first (as `prediction_table` names them)."""
    if inputs is None:
        return [json.dumps(r, ensure_ascii=False) for r in records]
    kept = inputs.drop(columns=[text_column]).reset_index(drop=True)
    extra = json.loads(kept.to_json(orient="records", force_ascii=False))  # numpy and NaN as JSON reads them
    lines = []
    for row, record in zip(extra, records, strict=True):
        record = {f"{k}_predicted" if k in row else k: v for k, v in record.items()}
        lines.append(json.dumps(row | record, ensure_ascii=False))
    return lines
