"""The train/validation/test splits of a run: read, checked, de-duplicated, split and sampled.

Every check on the user's data happens here, before any model is loaded, so that a bad row costs seconds,
not a model load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
from sklearn.model_selection import train_test_split

from loracls.config import TrainConfig
from loracls.data.labels import (
    is_multi_label,
    label_counts,
    label_ids,
    label_names,
    merge_case_variants,
    opaque_labels,
    resolve_label_type,
    separator,
    sort_labels,
)
from loracls.data.tables import read_labelled
from loracls.errors import LoraclsError


@dataclass
class Splits:
    """Train/validation/test tables with columns `id`, `text`, `label`.

    A label is a string; in a multi-label task, a sorted tuple of strings (possibly empty).
    """

    train: pd.DataFrame
    val: pd.DataFrame
    test: pd.DataFrame
    labels: list[str]
    """Class names in label-id order."""
    notes: list[str] = field(default_factory=list)
    """What was removed or sampled on the way, for the user to read."""
    label_type: str = "str"
    """`int` or `str`: the type outputs give labels in (`label_value`)."""

    @property
    def label2id(self) -> dict[str, int]:
        return label_ids(self.labels)


def load_splits(cfg: TrainConfig) -> Splits:
    """Read, check and split the data named by `cfg`; raise `LoraclsError` on anything a user must fix."""
    notes: list[str] = []

    def read(source: str | None) -> pd.DataFrame | None:
        if not source:
            return None
        return read_labelled(
            source, cfg.text_column, cfg.label_column, separator(cfg), cfg.response_column, notes
        )

    tables = merge_case_variants([read(cfg.data), read(cfg.val), read(cfg.test)], cfg, notes)
    table, val, test = (
        None if t is None else deduplicate(t, source, cfg.dedup, notes)
        for t, source in zip(tables, (cfg.data, cfg.val, cfg.test), strict=True)
    )

    if test is None:
        table, test = stratified_split(table, cfg.test_fraction, cfg.seed, f"test split of {cfg.data}", notes)
    if val is None:
        share = cfg.val_fraction / (1 - (0 if cfg.test else cfg.test_fraction))
        table, val = stratified_split(table, share, cfg.seed, f"validation split of {cfg.data}", notes)
    labels = sort_labels(label_names(table["label"]))
    if len(labels) < 2:
        raise LoraclsError(f"{cfg.data}: training data has only one class ({labels!r}); need at least 2.")
    kind = resolve_label_type(labels, cfg)
    opaque = opaque_labels(labels)
    if opaque and cfg.verbalizers is None and (cfg.baseline or cfg.prompted or cfg.head_init == "auto"):
        notes.append(
            f"labels {opaque} carry no meaning a prompt can read (the baseline and the prompt that can start "
            "the head see these names as the answers): name each class with --verbalizers "
            + ",".join(f"{name}=<word>" for name in labels)
        )
    for name, split in (("validation", val), ("test", test)):
        unseen = sorted(label_names(split["label"]) - set(labels))
        if unseen:
            raise LoraclsError(
                f"The {name} data has label(s) {unseen} that never occur in the training data {labels}."
            )
    train, val, test = drop_shared(table, val, test, cfg.dedup, notes)
    for name, split in (("training", train), ("validation", val), ("test", test)):
        if split.empty:
            removed = "; ".join(n for n in notes if n.startswith(("leakage", "duplicates"))) or "none removed"
            raise LoraclsError(
                f"No {name} examples remain after duplicates and texts shared between splits were removed "
                f"({removed}). Give training, validation and test data that differ (not the same file "
                "twice), or dedup=keep to keep shared texts and accept inflated scores."
            )
    if cfg.max_train_examples and len(train) > cfg.max_train_examples:
        train = stratified_sample(train, cfg.max_train_examples, cfg.seed)
        notes.append(f"sampled {len(train)} training examples (max_train_examples)")
    if cfg.train_fraction and cfg.train_fraction < 1:
        train = stratified_sample(train, max(len(labels), round(cfg.train_fraction * len(train))), cfg.seed)
        notes.append(f"sampled {len(train)} training examples (train_fraction {cfg.train_fraction})")
    counts = label_counts(train["label"], labels)
    if min(counts.values()) * 3 <= max(counts.values()):
        notes.append(
            f"class imbalance in train: {counts}; watch macro-F1 rather than accuracy, and consider "
            "class_weights=true"
        )
    if cfg.max_eval_examples:
        val = stratified_sample(val, cfg.max_eval_examples, cfg.seed)
        test = stratified_sample(test, cfg.max_eval_examples, cfg.seed)
    return Splits(
        train.reset_index(drop=True),
        val.reset_index(drop=True),
        test.reset_index(drop=True),
        labels,
        notes,
        kind,
    )


def deduplicate(table: pd.DataFrame, name: str, policy: str, notes: list[str]) -> pd.DataFrame:
    """Apply the `dedup` policy to repeated texts within one table.

    `drop` keeps the first copy of each text and drops texts that appear under more than one label; `keep`
    only reports them; `error` refuses the file.
    """
    labels_per_text = table.groupby("text")["label"].nunique()
    conflicting = set(labels_per_text.index[labels_per_text > 1])
    in_conflict = int(table["text"].isin(conflicting).sum())
    repeated = int(table["text"].duplicated().sum())
    if not repeated:
        return table
    found = f"{repeated} repeated texts ({len(conflicting)} of them under more than one label)"
    if policy == "error":
        example = table["text"][table["text"].duplicated()].iloc[0]
        raise LoraclsError(
            f"{name}: {found}, e.g. {example[:80]!r}. Set dedup=drop to keep one copy of each (and drop "
            "texts labelled two ways), or dedup=keep to train on them as they are."
        )
    if policy == "keep":
        notes.append(f"{name}: {found}; kept (dedup=keep)")
        return table
    kept = table[~table["text"].isin(conflicting)].drop_duplicates("text")
    notes.append(
        f"{name}: {len(table)} rows, removed {len(table) - len(kept) - in_conflict} duplicates and "
        f"{in_conflict} rows of {len(conflicting)} texts labelled both ways; {len(kept)} remain"
    )
    return kept.reset_index(drop=True)


def drop_shared(
    train: pd.DataFrame, val: pd.DataFrame, test: pd.DataFrame, policy: str, notes: list[str]
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Texts in two splits inflate the scores (the model is tested on what it trained on): apply `dedup`.

    `drop` removes them from train (and from validation when the test split has them), so the evaluation
    splits stay as given.
    """
    held = set(val["text"]) | set(test["text"])
    in_train = int(train["text"].isin(held).sum())
    in_val = int(val["text"].isin(set(test["text"])).sum())
    if not (in_train or in_val):
        return train, val, test
    found = f"{in_train} training texts also occur in validation/test, {in_val} validation texts in test"
    if policy == "error":
        raise LoraclsError(
            f"Leakage between splits: {found}. Set dedup=drop to remove them from the training (and "
            "validation) data, or dedup=keep to accept inflated scores."
        )
    if policy == "keep":
        notes.append(f"leakage: {found}; kept (dedup=keep): test scores will be optimistic")
        return train, val, test
    notes.append(f"leakage: {found}; removed from train/validation")
    return train[~train["text"].isin(held)], val[~val["text"].isin(set(test["text"]))], test


def stratified_split(
    table: pd.DataFrame, share: float, seed: int, what: str, notes: list[str] | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Stratified by label; multi-label tables by label combination, or at random when combinations are too
    rare to stratify (said in `notes`)."""
    multi = is_multi_label(table["label"])
    key = table["label"].map("\x1f".join) if multi else table["label"]
    try:
        rest, held = train_test_split(table, test_size=share, stratify=key, random_state=seed)
    except ValueError as e:
        if multi:
            if notes is not None:
                notes.append(f"{what}: label combinations too rare to stratify; split at random")
            return tuple(train_test_split(table, test_size=share, random_state=seed))
        counts = table["label"].value_counts().to_dict()
        raise LoraclsError(
            f"Cannot make the {what}: {e}. Class counts: {counts}. "
            "Add examples of the rare classes or pass --val/--test files."
        ) from None
    return rest, held


def stratified_sample(table: pd.DataFrame, n: int, seed: int) -> pd.DataFrame:
    if len(table) <= n:
        return table
    return stratified_split(table, 1 - n / len(table), seed, what=f"sample of {n}")[0]
