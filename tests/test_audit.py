"""`loracls data audit` (`training/audit.py`): labels flipped on purpose are found, and the command writes the
flagged rows ranked and the data without them."""

import numpy as np
import pandas as pd
import pytest

from loracls.errors import LoraclsError
from loracls.training.audit import label_issues, out_of_sample_probs
from tests.conftest import invoke, toy_reviews


def flipped_table(n_per_class: int, classes: int, share: float, seed: int = 0):
    """Features in well-separated clusters, one per class, and a table whose labels have `share` flipped."""
    rng = np.random.default_rng(seed)
    gold = np.repeat(np.arange(classes), n_per_class)
    features = rng.normal(0, 1, (len(gold), 8)) + 4 * np.eye(classes, 8)[gold]
    given = gold.copy()
    flipped = rng.choice(len(gold), round(share * len(gold)), replace=False)
    given[flipped] = (gold[flipped] + rng.integers(1, classes, len(flipped))) % classes
    labels = [f"c{k}" for k in range(classes)]
    table = pd.DataFrame({"id": range(len(gold)), "text": [f"t{i}" for i in range(len(gold))]})
    return features, table.assign(label=[labels[k] for k in given]), given, set(flipped.tolist()), labels


def test_flipped_labels_are_found_and_ranked_by_the_probability_of_the_given_one():
    features, table, given, flipped, labels = flipped_table(100, 3, 0.1)
    probs = out_of_sample_probs(features, given, folds=5, seed=0)
    issues = label_issues(table, probs, labels)
    found = set(issues["id"])
    precision, recall = len(found & flipped) / len(found), len(found & flipped) / len(flipped)
    assert precision >= 0.8 and recall >= 0.8, (precision, recall)
    assert issues["p_label"].is_monotonic_increasing  # the most suspicious first
    assert (issues["suggested"] != issues["label"]).mean() > 0.9


def test_a_class_of_one_example_cannot_be_cross_validated():
    features = np.random.default_rng(0).normal(size=(7, 4))
    with pytest.raises(LoraclsError, match="single example"):
        out_of_sample_probs(features, np.array([0, 0, 0, 1, 1, 1, 2]), folds=5, seed=0)


def test_the_command_writes_the_flagged_rows_and_the_data_without_them(tiny_models, tmp_path):
    data = toy_reviews(200).rename(columns={"text": "review", "label": "sentiment"})
    flip = {"positive": "negative", "negative": "positive"}
    data.loc[:19, "sentiment"] = data.loc[:19, "sentiment"].map(flip)
    data.insert(0, "id", [f"r{i}" for i in range(len(data))])
    path = tmp_path / "reviews.csv"
    data.to_csv(path, index=False)
    issues, kept = tmp_path / "issues.csv", tmp_path / "kept.csv"
    columns = ("--text-column", "review", "--label-column", "sentiment", "--max-length", "64")
    result = invoke(
        "data", "audit", path, "--model", tiny_models["llama"], *columns,
        "--out", issues, "--clean-out", kept, "--top", "3",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    flagged = pd.read_csv(issues)
    assert list(flagged.columns) == ["id", "text", "label", "suggested", "p_label", "p_suggested"]
    assert 0 < len(flagged) < len(data) and flagged["p_label"].is_monotonic_increasing
    assert f"{len(flagged)} rows flagged" in result.output and f"written to {issues}" in result.output
    shown = [line for line in result.output.splitlines() if line.startswith("│")]  # --top 3, a line each
    assert [line.split("│")[1].strip() for line in shown] == list(flagged["id"][:3])
    assert all(len(line) <= 80 for line in shown)
    original = data.set_index("id")
    assert (flagged["label"] == original.loc[flagged["id"], "sentiment"].to_numpy()).all()  # as given
    rest = pd.read_csv(kept)
    assert list(rest.columns) == ["id", "review", "sentiment"]  # trains again with the same options
    assert len(rest) == len(data) - len(flagged) and not set(rest["id"]) & set(flagged["id"])


def test_outputs_it_cannot_write_are_refused_before_the_model_loads(tmp_path, toy_csv):
    result = invoke("data", "audit", toy_csv, "--out", tmp_path / "issues.txt")
    assert result.exit_code != 0 and "issues.txt: write .csv or .jsonl" in result.output
    result = invoke("data", "audit", toy_csv, "--out", tmp_path / "missing" / "issues.csv")
    assert result.exit_code != 0 and "does not exist" in result.output
    result = invoke("data", "audit", tmp_path / "nothing.csv")
    assert result.exit_code != 0 and "not found" in result.output
