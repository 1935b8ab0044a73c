"""Reading labelled files (CSV, JSON Lines, Parquet, Excel, the built-in datasets): encodings, column checks
and the rows that are refused."""

import gzip
import json
import re
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from loracls.config import TrainConfig, field_docs
from loracls.data.splits import load_splits
from loracls.data.tables import COMPRESSIONS, READERS, read_labelled
from loracls.errors import LoraclsError
from tests.conftest import toy_reviews


def test_missing_column_lists_the_columns(toy_csv):
    with pytest.raises(LoraclsError, match=r"no text column 'review'.*\['text', 'label'\]"):
        load_splits(TrainConfig(data=str(toy_csv), text_column="review"))


def test_non_utf8_file_is_named(tmp_path):
    path = tmp_path / "gbk.csv"
    path.write_bytes("text,label\n很好,1\n".encode("gbk"))
    with pytest.raises(LoraclsError, match="gbk.csv is not UTF-8"):
        read_labelled(str(path), "text", "label")


def test_every_bad_row_of_a_csv_is_reported_at_once_by_its_file_line(tmp_path):
    """Empty texts were reported first and missing labels only once those were fixed, as 0-based row numbers,
    and `''` and a missing cell both printed as nan: now every kind at once, by file line, as written."""
    path = tmp_path / "d.csv"
    path.write_text('text,label\nfine,a\n,b\n"two\nlines",a\nno label\n"",\nok,a\n', encoding="utf-8")
    with pytest.raises(LoraclsError) as refused:
        read_labelled(str(path), "text", "label")
    message = str(refused.value)
    assert f"{path}: 3 row(s) cannot be used" in message
    assert f"empty text in column 'text' in 2 row(s): line 3 of {path} (''), line 7 of {path} ('')" in message
    assert (
        f"missing label in column 'label' in 2 row(s): line 6 of {path} (missing), line 7 of {path} ('')"
        in (message)
    )


def test_every_bad_row_of_a_jsonl_file_is_reported_by_its_line(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [
        {"text": "", "label": "a"},
        None,
        {"label": "b"},
        {"text": "fine", "label": None},
        {"text": 7, "label": "a"},
        {"text": "fine too", "label": [1, 2]},
        {"text": "  ", "label": "  "},
    ]
    path.write_text("\n".join("" if r is None else json.dumps(r) for r in lines) + "\n", encoding="utf-8")
    with pytest.raises(LoraclsError) as refused:
        read_labelled(str(path), "text", "label")
    message = str(refused.value)
    assert f"{path}: 6 row(s) cannot be used" in message
    assert (
        f"empty text in column 'text' in 3 row(s): line 1 of {path} (''), line 3 of {path} (missing), "
        f"line 7 of {path} ('  ')"
    ) in message
    assert (
        f"missing label in column 'label' in 2 row(s): line 4 of {path} (missing), line 7 of {path} ('  ')"
        in (message)
    )
    assert f"text that is not a string in column 'text' in 1 row(s): line 5 of {path} (7)" in message
    assert (
        f"label that is not one string or number in column 'label' in 1 row(s): line 6 of {path} ([1, 2])"
        in (message)
    )


def test_bad_multi_labels_and_responses_are_reported_with_the_empty_texts(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"text": "a", "label": "x,y", "answer": "fine"},
        {"text": "", "label": "x", "answer": 3},
        {"text": "b", "label": {"x": 1}, "answer": None},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(LoraclsError) as refused:
        read_labelled(str(path), "text", "label", separator=",", response_column="answer")
    message = str(refused.value)
    assert f"empty text in column 'text' in 1 row(s): line 2 of {path} ('')" in message
    assert (
        f"labels that are not strings or numbers in column 'label' in 1 row(s): line 3 of {path} ({{'x': 1}})"
        in (message)
    )
    assert f"response that is not text in column 'answer' in 1 row(s): line 2 of {path} (3)" in message


def test_more_than_five_bad_rows_of_a_kind_are_counted(tmp_path):
    path = tmp_path / "d.csv"
    pd.DataFrame({"text": ["ok"] + [" "] * 8, "label": ["a"] * 9}).to_csv(path, index=False)
    with pytest.raises(LoraclsError, match=rf"line 7 of {re.escape(str(path))} \(' '\), and 3 more"):
        read_labelled(str(path), "text", "label")


def test_missing_columns_are_named_together(tmp_path):
    path = tmp_path / "d.csv"
    pd.DataFrame({"review": ["a"], "stars": [1]}).to_csv(path, index=False)
    with pytest.raises(
        LoraclsError, match=r"no text column 'text', no label column 'label'\. Columns present"
    ):
        read_labelled(str(path), "text", "label")


def test_en_tweets_has_three_classes():
    table = read_labelled("en-tweets", "text", "label")
    assert set(table["label"]) == {"negative", "neutral", "positive"}
    assert len(table) > 30000


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    """pandas writes U+2028 and U+0085 raw inside JSON strings: a JSON Lines file ends its lines at \\n only
    (reading them as line breaks refused a valid file of real movie reviews)."""
    path = tmp_path / "reviews.jsonl"
    table = pd.DataFrame({"text": ["one\u2028two", "three\x85four", "five\rsix"], "label": ["a", "b", "a"]})
    table.to_json(path, orient="records", lines=True, force_ascii=False)
    assert "\u2028" in path.read_text(encoding="utf-8")  # raw in the file, not escaped
    read = read_labelled(str(path), "text", "label")
    assert list(read["text"]) == list(table["text"]) and list(read["label"]) == ["a", "b", "a"]


def test_whitespace_stripped_from_labels_is_noted(tmp_path):
    path = tmp_path / "spaced.jsonl"
    table = toy_reviews(60)
    table.loc[table["label"] == "positive", "label"] = " pos"
    table.loc[::4, "label"] = "pos"
    table.to_json(path, orient="records", lines=True)
    splits = load_splits(TrainConfig(data=str(path)))
    assert set(splits.labels) == {"negative", "pos"}
    assert any("stripped surrounding whitespace from label(s) [' pos']" in n for n in splits.notes)


def test_a_non_utf8_file_gets_the_iconv_line_with_its_path_as_given(tmp_path, monkeypatch):
    """The hint named the bare file (`waimai_gbk.csv`) though the user gave `data/waimai_gbk.csv`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    gbk = "text,label\n很好,1\n".encode("gbk")
    (tmp_path / "data" / "waimai_gbk.csv").write_bytes(gbk)
    with pytest.raises(
        LoraclsError, match=re.escape("`iconv -f GBK -t UTF-8 data/waimai_gbk.csv > fixed.csv`")
    ):
        read_labelled("data/waimai_gbk.csv", "text", "label")
    (tmp_path / "data" / "waimai_gbk.csv.gz").write_bytes(gzip.compress(gbk))
    with pytest.raises(
        LoraclsError, match=re.escape("`gzip -dc data/waimai_gbk.csv.gz | iconv -f GBK -t UTF-8 > fixed.csv`")
    ):
        read_labelled("data/waimai_gbk.csv.gz", "text", "label")


def test_an_excel_file_is_read_with_its_sheet_rows_named(tmp_path):
    path = tmp_path / "reviews.xlsx"
    table = toy_reviews(60)
    table.to_excel(path, index=False)
    splits = load_splits(TrainConfig(data=str(path)))
    assert splits.labels == ["negative", "positive"]
    assert len(splits.train) + len(splits.val) + len(splits.test) == 60
    table.loc[4, "text"] = None  # an empty cell in sheet row 6 (row 1 holds the header)
    table["label"] = [i % 2 for i in range(60)]  # numbers in the sheet, read as the labels 0 and 1
    table.to_excel(path, index=False)
    with pytest.raises(
        LoraclsError, match=re.escape(f"empty text in column 'text' in 1 row(s): row 6 of {path} (missing)")
    ):
        read_labelled(str(path), "text", "label")
    table.loc[4, "text"] = "filled"
    table.to_excel(path, index=False)
    assert list(read_labelled(str(path), "text", "label")["label"]) == [str(i % 2) for i in range(60)]


@pytest.mark.parametrize("name", ["d.csv.gz", "d.tsv.bz2", "d.jsonl.xz", "d.csv.zip", "d.json.gz"])
def test_compressed_files_are_read_as_their_suffix_says(tmp_path, name):
    path = tmp_path / name
    table = toy_reviews(60)
    if ".json" in name:
        table.to_json(path, orient="records", lines=".jsonl" in name, force_ascii=False)
    else:
        table.to_csv(path, index=False, sep="\t" if ".tsv" in name else ",")
    read = read_labelled(str(path), "text", "label")
    assert list(read["text"]) == list(table["text"]) and list(read["label"]) == list(table["label"])
    splits = load_splits(TrainConfig(data=str(path)))
    assert len(splits.train) + len(splits.val) + len(splits.test) == 60


def test_a_zip_named_for_nothing_is_read_as_the_file_it_holds(tmp_path):
    path = tmp_path / "download.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("reviews.tsv", toy_reviews(20).to_csv(index=False, sep="\t"))
    assert list(read_labelled(str(path), "text", "label")["text"]) == list(toy_reviews(20)["text"])
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("other.csv", "text,label\n")
    with pytest.raises(
        LoraclsError,
        match=r"download.zip could not be read as a zip file: it holds 2 files \(reviews.tsv, other.csv\)",
    ):
        read_labelled(str(path), "text", "label")
    named = path.rename(path.with_name("download.csv.zip"))  # the name says csv: read when decompressed
    with pytest.raises(LoraclsError, match=r"download.csv.zip could not be decompressed as .zip: it holds 2"):
        read_labelled(str(named), "text", "label")


def test_excel_without_openpyxl_says_how_to_install_it(tmp_path, monkeypatch):
    path = tmp_path / "reviews.xlsx"
    toy_reviews(10).to_excel(path, index=False)
    monkeypatch.setitem(
        sys.modules, "openpyxl", None
    )  # `import openpyxl` now fails as if it were not installed
    with pytest.raises(
        LoraclsError, match=re.escape(f"{path}: reading Excel needs openpyxl: pip install 'loracls[excel]'")
    ):
        read_labelled(str(path), "text", "label")


def test_every_file_format_is_listed_where_data_is_explained():
    """`--data`'s help (TrainConfig.data's docstring) said "CSV, JSONL or Parquet" though TSV was read too."""
    help_text = field_docs()["data"]
    guide = (Path(__file__).parents[1] / "docs" / "data.md").read_text(encoding="utf-8")
    for suffix in [*READERS, *COMPRESSIONS]:
        assert f"`{suffix}`" in help_text and f"`{suffix}`" in guide, suffix
    assert "pip install 'loracls[excel]'" in guide
