"""Property-based tests of the data loader: whatever a file holds, it loads correctly or raises our error."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import tempfile
import zipfile
from pathlib import Path

import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loracls.data.tables import read_labelled
from loracls.errors import LoraclsError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
cells = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        ["", " ", "\n", '"', '""', ",", "a,b", "\t", "\ufeff", "NaN", "null", "None", "1", "1.0"]
    ),
)
values = st.one_of(
    cells,
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
encodings = st.sampled_from(["utf-8", "utf-8-sig", "gbk", "latin-1", "utf-16", "cp1252"])


def check(path: Path) -> None:
    """The property: a clean table of non-empty texts and string labels, or a LoraclsError naming the file."""
    try:
        table = read_labelled(str(path), "text", "label")
    except LoraclsError as e:
        assert str(path) in str(e) or path.name in str(e)
        return
    assert list(table.columns) == ["id", "text", "label"]
    assert all(isinstance(t, str) and t.strip() for t in table["text"])
    assert all(isinstance(label, str) for label in table["label"])


def write(data: bytes, suffix: str) -> Path:
    folder = Path(tempfile.mkdtemp())
    path = folder / f"data{suffix}"
    path.write_bytes(data)
    return path


def encode(text: str, encoding: str) -> bytes:
    return text.encode(encoding, errors="replace")


@SETTINGS
@given(
    header=st.lists(st.sampled_from(["text", "label", "id", "other", "", "text "]), min_size=1, max_size=4),
    rows=st.lists(st.lists(cells, min_size=0, max_size=5), max_size=8),
    quoting=st.sampled_from([csv.QUOTE_MINIMAL, csv.QUOTE_ALL, csv.QUOTE_NONNUMERIC]),
    delimiter=st.sampled_from([",", "\t", ";"]),
    encoding=encodings,
    suffix=st.sampled_from([".csv", ".tsv"]),
)
def test_any_csv_loads_or_raises_our_error(header, rows, quoting, delimiter, encoding, suffix):
    buffer = io.StringIO()
    writer = csv.writer(buffer, quoting=quoting, delimiter=delimiter, escapechar="\\")
    for row in [header, *rows]:
        writer.writerow(row)
    check(write(encode(buffer.getvalue(), encoding), suffix))


@SETTINGS
@given(
    records=st.lists(
        st.one_of(
            st.fixed_dictionaries({"text": values, "label": values}),
            st.dictionaries(st.sampled_from(["text", "label", "id", "x"]), values, max_size=4),
            values,
        ),
        max_size=8,
    ),
    broken=st.booleans(),
    encoding=encodings,
    suffix=st.sampled_from([".jsonl", ".json"]),
)
def test_any_json_loads_or_raises_our_error(records, broken, encoding, suffix):
    text = "\n".join(json.dumps(r) for r in records) if suffix == ".jsonl" else json.dumps(records)
    if broken:
        text = text[: len(text) // 2]
    check(write(encode(text, encoding), suffix))


@SETTINGS
@given(
    data=st.binary(max_size=200),
    suffix=st.sampled_from(
        [
            ".csv",
            ".tsv",
            ".jsonl",
            ".json",
            ".parquet",
            ".xlsx",
            ".csv.gz",
            ".jsonl.bz2",
            ".tsv.xz",
            ".zip",
            ".csv.zip",
        ]
    ),
)
def test_any_bytes_load_or_raise_our_error(data, suffix):
    check(write(data, suffix))


@SETTINGS
@given(data=st.binary(max_size=200), suffix=st.sampled_from([".csv.gz", ".jsonl.bz2", ".tsv.xz", ".csv.zip"]))
def test_any_compressed_bytes_load_or_raise_our_error(data, suffix):
    """Bytes that decompress, holding anything: as `test_any_bytes_load_or_raise_our_error` once unpacked."""
    check(write(compress(data, suffix), suffix))


def compress(data: bytes, suffix: str) -> bytes:
    if suffix.endswith(".zip"):
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr("data" + suffix.removesuffix(".zip"), data)
        return buffer.getvalue()
    return {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[Path(suffix).suffix](data)


def test_a_valid_file_round_trips(tmp_path):
    path = tmp_path / "d.csv"
    frame = pd.DataFrame({"text": ['say "hi", then\nleave', "b"], "label": [1, 0]})
    frame.to_csv(path, index=False)
    table = read_labelled(str(path), "text", "label")
    assert list(table["text"]) == ['say "hi", then\nleave', "b"] and list(table["label"]) == ["1", "0"]
