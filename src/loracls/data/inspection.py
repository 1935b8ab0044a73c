"""`loracls data inspect`: what is in the data files, reported before any model loads."""

from __future__ import annotations

import pandas as pd
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedTokenizerBase

from loracls.config import TrainConfig
from loracls.data.labels import case_variants, label_counts, label_names, separator, sort_labels, spellings
from loracls.data.tables import read_labelled


def inspect_data(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> dict:
    """What `loracls data inspect` reports: sizes, labels, duplicates, cross-split leakage and lengths.

    Fatal problems (missing file or column, empty texts, missing labels) raise `LoraclsError` as for `train`;
    everything else is reported, so a user sees the whole picture before a model loads.
    """
    files = {"data": cfg.data, "val": cfg.val, "test": cfg.test}
    findings: list[str] = []
    tables = {
        role: read_labelled(source, cfg.text_column, cfg.label_column, separator(cfg), notes=findings)
        for role, source in files.items()
        if source
    }
    report: dict = {"files": {role: files[role] for role in tables}, "splits": {}}
    for role, table in tables.items():
        counts = label_counts(table["label"], sort_labels(label_names(table["label"])))
        repeated = int(table["text"].duplicated().sum())
        conflicting = int((table.groupby("text")["label"].nunique() > 1).sum())
        chars = table["text"].str.len()
        split = {
            "rows": len(table),
            "labels": counts,
            "duplicate_texts": repeated,
            "texts_with_conflicting_labels": conflicting,
            "chars": {q: int(chars.quantile(p)) for q, p in (("p50", 0.5), ("p95", 0.95), ("max", 1.0))},
        }
        if tokenizer is not None:
            lengths = [len(ids) for ids in tokenizer(list(table["text"]), truncation=False)["input_ids"]]
            over = sum(n > cfg.max_length for n in lengths)
            split["tokens"] = {"p50": int(pd.Series(lengths).median()), "max": max(lengths)}
            split["truncated_share"] = over / len(lengths)
            if over:
                findings.append(
                    f"{role}: {over / len(lengths):.1%} of texts exceed max_length={cfg.max_length} tokens"
                )
        if repeated:
            findings.append(f"{role}: {repeated} repeated texts ({conflicting} texts under different labels)")
        rare = [label for label, n in split["labels"].items() if n < 2]
        if rare:
            findings.append(f"{role}: label(s) {rare} have under 2 examples: no stratified split possible")
        if len(counts) < 2:
            findings.append(f"{role}: only one label ({list(counts)}); a classifier needs at least 2")
        for group in case_variants(counts):
            findings.append(
                f"{role}: labels {spellings(group, counts)} differ only in case: train refuses them "
                "unless --merge-label-case merges them"
            )
        report["splits"][role] = split
    train_texts = set(tables["data"]["text"])
    for role in ("val", "test"):
        if role in tables:
            shared = train_texts & set(tables[role]["text"])
            report["splits"][role]["also_in_train"] = len(shared)
            if shared:
                findings.append(f"{role}: {len(shared)} texts also occur in the training data (leakage)")
            unseen = sorted(label_names(tables[role]["label"]) - label_names(tables["data"]["label"]))
            if unseen:
                findings.append(f"{role}: label(s) {unseen} never occur in the training data")
    report["findings"] = findings
    return report


def print_inspection(report: dict, console: Console) -> None:
    """`inspect_data`'s report as `loracls data-inspect` prints it: the splits' table, then the findings."""
    table = Table(
        "split", "rows", "labels", "repeated", "chars p50/p95/max", "tokens p50/max", "> max_length"
    )
    for role, split in report["splits"].items():
        tokens = split.get("tokens")
        table.add_row(
            role,
            str(split["rows"]),
            ", ".join(f"{k} {v}" for k, v in split["labels"].items()),
            str(split["duplicate_texts"]),
            "/".join(str(v) for v in split["chars"].values()),
            f"{tokens['p50']}/{tokens['max']}" if tokens else "-",
            f"{split['truncated_share']:.1%}" if tokens else "-",
        )
    console.print(table)
    for finding in report["findings"]:
        console.print(f"- {finding}", soft_wrap=True)
