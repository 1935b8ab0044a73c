"""A split's table as token ids: the `datasets.Dataset` training and evaluation batch from."""

from __future__ import annotations

import pandas as pd
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from loracls.console import progress
from loracls.data.labels import is_multi_label
from loracls.data.prompts import Prompter
from loracls.errors import LoraclsError

CHUNK = 1024
"""Texts tokenised at a time: a fast tokenizer's batch is as quick as the whole list, and the bar moves."""


def tokenize(
    table: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    label2id: dict[str, int],
    prompter: Prompter | None = None,
    stage: str | None = None,
    long_texts: str = "cut",
    stride: int | None = None,
) -> Dataset:
    """A `datasets.Dataset` with `input_ids` and integer `labels`; padding happens per batch, later.

    With `prompter`, each text (cut to `max_length` tokens) is read inside the prompt. `long_texts` `mean` or
    `max`: a text over `max_length` tokens becomes overlapping windows (`split_windows`, `stride` apart, None:
    half a window), a row each, and the `owner` column says which text each row reads. `stage` names a
    progress bar over the texts, `CHUNK` at a time (None: none)."""
    if long_texts != "cut":
        size = window_tokens(tokenizer, max_length, prompter)
        texts, owner = split_windows(list(table["text"]), tokenizer, size, stride)
        windows = table.iloc[owner].assign(text=texts)
        dataset = tokenize(windows, tokenizer, max_length, label2id, prompter, stage)
        return dataset.add_column("owner", owner)
    if is_multi_label(table["label"]):  # multi-hot float targets for binary cross-entropy
        targets = [[float(name in names) for name in label2id] for names in table["label"]]
    else:
        targets = [label2id[x] for x in table["label"]]
    # tokenized directly: `Dataset.map` would pickle the whole tokenizer to fingerprint the function, which
    # took ~6 s per call for Gemma's 262k-token vocabulary, more than tokenizing 2,000 texts
    texts, input_ids = list(table["text"]), []
    with progress(stage, len(texts), "texts") as shown:
        for start in range(0, len(texts), CHUNK):
            part = texts[start : start + CHUNK]
            if prompter is not None:
                input_ids += prompter.encode(part)
            else:
                input_ids += tokenizer(part, truncation=True, max_length=max_length)["input_ids"]
            shown.advance(len(part))
    return Dataset.from_dict({"input_ids": input_ids, "labels": targets})


def tokenize_responses(table: pd.DataFrame, prompter: Prompter, label2id: dict[str, int]) -> Dataset:
    """The training set of an `objective: lm` run: `input_ids` (prompt, then response:
    `Prompter.encode_responses`), `response_start` (where the response's tokens begin) and `labels`."""
    comments = list(table["response"]) if "response" in table.columns else None
    input_ids, starts = prompter.encode_responses(list(table["text"]), list(table["label"]), comments)
    labels = [label2id[x] for x in table["label"]]
    return Dataset.from_dict({"input_ids": input_ids, "response_start": starts, "labels": labels})


def truncated_share(table: pd.DataFrame, tokenizer: PreTrainedTokenizerBase, max_length: int) -> float:
    """The share of `table`'s texts longer than `max_length` tokens (cut to it, whatever prompt they are read
    inside)."""
    if table.empty:  # a fast tokenizer given no texts raises IndexError
        return 0.0
    lengths = [len(x) for x in tokenizer(list(table["text"]), add_special_tokens=False)["input_ids"]]
    return sum(n > max_length for n in lengths) / len(lengths)


def window_tokens(tokenizer: PreTrainedTokenizerBase, max_length: int, prompter: Prompter | None) -> int:
    """A text's tokens that one reading holds: `max_length`, less the tokenizer's special tokens where a bare
    text is read (they count against its cut; inside a prompt they do not)."""
    return max_length if prompter is not None else max_length - len(tokenizer("")["input_ids"])


def split_windows(
    texts: list[str], tokenizer: PreTrainedTokenizerBase, size: int, stride: int | None = None
) -> tuple[list[str], list[int]]:
    """Texts of more than `size` tokens as overlapping windows of `size` tokens, `stride` tokens apart (None:
    half a window; beyond a window: a window, side by side; the last window ends at the text's end),
    decoded back to text so that each is read as any text is (inside the run's prompt); shorter texts stay
    whole. Returns the windows and, for each, the text it came from."""
    if stride is not None and stride < 1:
        raise LoraclsError(f"--stride must be at least 1, not {stride}")
    stride = min(stride or max(1, size // 2), size)
    own = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if len(texts) else []
    windows, owner = [], []
    for n, (text, ids) in enumerate(zip(texts, own, strict=True)):
        if len(ids) <= size:
            windows.append(text)
            owner.append(n)
            continue
        starts = list(range(0, len(ids) - size, stride)) + [len(ids) - size]
        windows += [tokenizer.decode(ids[start : start + size]) for start in starts]
        owner += [n] * len(starts)
    return windows, owner
