"""Label names: how a cell becomes a label, label types, case variants, counts and order.

A label is a string (`1`, `1.0` and `"1"` are the same class); in a multi-label task, a sorted tuple of
strings. Outputs give labels back in the run's `label_type` (`label_value`).
"""

from __future__ import annotations

import pandas as pd

from loracls.config import TrainConfig
from loracls.errors import LoraclsError


def label_ids(labels: list[str]) -> dict[str, int]:
    """Each label's class index: its place in the run's label order (`labels.json`, the head's rows)."""
    return {name: i for i, name in enumerate(labels)}


def is_integer(name: str) -> bool:
    """`3`, `-1`; not `007` or `1.5` (their integer would not read back as the same label)."""
    try:
        return str(int(name)) == name
    except ValueError:
        return False


def resolve_label_type(labels: list[str], cfg: TrainConfig) -> str:
    """`cfg.label_type`, with `auto` decided: `int` when every label is an integer."""
    integers = all(is_integer(name) for name in labels)
    if cfg.label_type == "int" and not integers:
        raise LoraclsError(
            f"label_type int: the labels {[n for n in labels if not is_integer(n)][:5]} are not integers; "
            "use label_type str (or auto)"
        )
    if cfg.label_type == "auto":
        return "int" if integers else "str"
    return cfg.label_type


def label_value(label: str | tuple | list, label_type: str) -> str | int | list:
    """A label (or a multi-label row's labels) as outputs write it: an `int` task's labels as integers."""
    if isinstance(label, tuple | list):
        return [label_value(name, label_type) for name in label]
    return int(label) if label_type == "int" else label


def opaque_labels(labels: list[str]) -> list[str]:
    """Label names that mean nothing to a language model: numbers and single characters."""
    return [name for name in labels if len(name) == 1 or name.lstrip("-").isdigit()]


def separator(cfg: TrainConfig) -> str | None:
    """The label separator of a multi-label task; None for a single-label one."""
    return cfg.label_separator if cfg.multi_label else None


def case_variants(counts: dict[str, int]) -> list[list[str]]:
    """Groups of label names that differ only in case (`Positive`, `positive`), each sorted."""
    groups: dict[str, list[str]] = {}
    for name in sorted(counts):
        groups.setdefault(name.casefold(), []).append(name)
    return [group for group in groups.values() if len(group) > 1]


def spellings(group: list[str], counts: dict[str, int]) -> str:
    return " and ".join(f"{name!r} ({counts[name]} rows)" for name in group)


def merge_case_variants(
    tables: list[pd.DataFrame | None], cfg: TrainConfig, notes: list[str]
) -> list[pd.DataFrame | None]:
    """Refuse labels that differ only in case (they would train as separate classes), or with
    `merge_label_case` rename each to its group's commonest spelling, in every table."""
    present = [t for t in tables if t is not None]
    counts: dict[str, int] = {}
    for table in present:
        for name, n in label_counts(table["label"], sorted(label_names(table["label"]))).items():
            counts[name] = counts.get(name, 0) + n
    groups = case_variants(counts)
    if not groups:
        return tables
    if not cfg.merge_label_case:
        found = "; ".join(spellings(group, counts) for group in groups)
        raise LoraclsError(
            f"{cfg.data}: labels {found} differ only in case and would train as separate classes. Fix the "
            "labels, or pass --merge-label-case (merge_label_case: true) to merge each into its commonest "
            "spelling."
        )
    rename = {}
    for group in groups:
        target = max(group, key=lambda name: (counts[name], name == name.lower()))
        rename |= {name: target for name in group if name != target}
        merged = ", ".join(f"{name!r} ({counts[name]} rows)" for name in group if name != target)
        notes.append(f"merged label {merged} into {target!r} ({counts[target]} rows) (merge_label_case)")
    for table in present:
        if is_multi_label(table["label"]):
            table["label"] = [tuple(sorted({rename.get(x, x) for x in names})) for names in table["label"]]
        else:
            table["label"] = [rename.get(x, x) for x in table["label"]]
    return tables


def is_multi_label(labels: pd.Series) -> bool:
    return len(labels) > 0 and isinstance(labels.iloc[0], tuple)


def label_names(labels: pd.Series) -> set[str]:
    """Every label name that occurs in a label column."""
    if is_multi_label(labels):
        return {name for names in labels for name in names}
    return set(labels)


def label_counts(labels: pd.Series, names: list[str]) -> dict[str, int]:
    """Rows per label name (a multi-label row counts for each of its labels)."""
    flat = [name for names in labels for name in names] if is_multi_label(labels) else list(labels)
    counts = pd.Series(flat, dtype=object).value_counts()
    return {name: int(counts.get(name, 0)) for name in names}


def label_str(value: object) -> str:
    """Labels are stored as strings; `1`, `1.0` and `"1"` are the same class."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


def sort_labels(values) -> list[str]:
    values = [str(v) for v in values]
    try:
        return sorted(values, key=int)
    except ValueError:
        return sorted(values)


def labels_line(labels: list[str], shown: int = 8) -> str:
    """The labels as one short console phrase: all of them up to `shown + 2`, else the first `shown` and how
    many more (77 intents would fill a screen; RUN/labels.json lists them all)."""
    if len(labels) <= shown + 2:
        return f"labels {labels}"
    first = ", ".join(repr(label) for label in labels[:shown])
    return f"{len(labels)} labels: {first} and {len(labels) - shown} more (all in RUN/labels.json)"
