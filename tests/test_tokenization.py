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
