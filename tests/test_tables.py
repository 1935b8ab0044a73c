"""Reading labelled files (CSV, JSON Lines, Parquet, Excel, the built-in datasets): encodings, column checks
and the rows that are refused."""

import pandas as pd
import pytest

from loracls.config import TrainConfig
from loracls.data.splits import load_splits
from loracls.data.tables import read_labelled
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


def test_empty_text_and_missing_label_rows_are_named(tmp_path):
    path = tmp_path / "d.csv"
    pd.DataFrame({"text": ["fine", " ", "ok"], "label": ["a", "b", "a"]}).to_csv(path, index=False)
    with pytest.raises(
        LoraclsError, match=r"empty or non-text 'text' in 1 row\(s\), first at data row\(s\) \[1\]"
    ):
        read_labelled(str(path), "text", "label")
    pd.DataFrame({"text": ["fine", "bad", "ok"], "label": ["a", None, "a"]}).to_csv(path, index=False)
    with pytest.raises(LoraclsError, match=r"missing label in 1 row"):
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
