"""A split's table as token ids: integer or multi-hot targets, texts cut to max_length, the share cut."""

from __future__ import annotations

import pandas as pd

from loracls.data.tokenization import tokenize, truncated_share
from tests.conftest import char_tokenizer


def test_texts_become_ids_cut_to_max_length_with_integer_labels():
    tokenizer = char_tokenizer()
    table = pd.DataFrame({"text": ["good", "a much longer text"], "label": ["pos", "neg"]})
    dataset = tokenize(table, tokenizer, 6, {"neg": 0, "pos": 1})
    assert dataset["labels"] == [1, 0]
    lengths = [len(ids) for ids in dataset["input_ids"]]
    assert lengths[1] == 6 and lengths[0] < 6  # the long text is cut, the short one is not padded
    assert tokenizer.decode(dataset["input_ids"][0], skip_special_tokens=True) == "good"


def test_several_labels_per_row_become_multi_hot_targets_in_label2id_order():
    table = pd.DataFrame({"text": ["ab", "cd"], "label": [("x", "z"), ("y",)]})
    dataset = tokenize(table, char_tokenizer(), 8, {"x": 0, "y": 1, "z": 2})
    assert dataset["labels"] == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]


def test_truncated_share_counts_the_texts_longer_than_the_limit():
    table = pd.DataFrame({"text": ["abc", "abcdef", "abcdefgh", "a"]})
    assert truncated_share(table, char_tokenizer(), 5) == 0.5
    assert truncated_share(table.iloc[:0], char_tokenizer(), 5) == 0.0  # no texts: no division by zero


def test_a_named_stage_shows_how_many_texts_are_tokenised_a_chunk_at_a_time(log_file, monkeypatch):
    """Tokenising 2,500 texts in chunks of 1,000 reports each chunk's progress and the same ids as one call;
    without a stage name nothing is printed."""
    from loracls.data import tokenization

    monkeypatch.setattr(tokenization, "CHUNK", 1000)
    table = pd.DataFrame({"text": [f"text {n}" for n in range(2500)], "label": "pos"})
    tokenizer = char_tokenizer()
    chunked = tokenize(table, tokenizer, 16, {"pos": 0}, stage="tokenize train")
    shown = log_file.getvalue()
    for done in ("1,000", "2,000", "2,500"):
        assert f"tokenize train: {done} of 2,500 texts" in shown, shown
    assert "done in" in shown
    whole = tokenizer(list(table["text"]), truncation=True, max_length=16)["input_ids"]
    assert chunked["input_ids"] == whole
    log_file.truncate(0)
    tokenize(table, tokenizer, 16, {"pos": 0})
    assert log_file.getvalue() == ""
