"""Labels: integer labels and their type, and spellings that differ only in case."""

import pandas as pd

from loracls.config import TrainConfig
from loracls.data.labels import labels_line
from loracls.data.splits import load_splits
from tests.conftest import toy_reviews


def test_integer_labels_sort_numerically(tmp_path):
    path = tmp_path / "d.jsonl"
    frame = toy_reviews(60)
    frame["label"] = [i % 11 for i in range(60)]
    frame.to_json(path, orient="records", lines=True)
    splits = load_splits(
        TrainConfig(data=str(path), val_fraction=0.2, test_fraction=0.2, max_train_examples=None)
    )
    assert splits.labels == [str(i) for i in range(11)]


def case_variant_csv(path, spellings=("positive", "Positive ", "negative")):
    """toy reviews whose positive rows are spelled two ways (every third one `Positive` with a space)."""
    table = toy_reviews(120)
    positive = table.index[table["label"] == "positive"]
    table.loc[positive[::3], "label"] = spellings[1]
    table.to_csv(path, index=False)
    return table


def test_labels_differing_only_in_case_are_refused_by_train_with_their_counts(tmp_path, tiny_models):
    """`Positive` and `positive` were two classes (with only an imbalance note): now train refuses before a
    model loads, naming both spellings, their rows, and the option that merges them."""
    from tests.conftest import FAST, invoke

    data = tmp_path / "mixed.csv"
    case_variant_csv(data)
    out = tmp_path / "run"
    result = invoke("train", "--model", tiny_models["llama"], "--data", data, "--out", out, *FAST)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "'Positive' (20 rows)" in message and "'positive' (40 rows)" in message
    assert "--merge-label-case" in message
    assert not (out / "status.json").exists()


def test_merge_label_case_merges_into_the_commonest_spelling_and_says_so(tmp_path):
    data = tmp_path / "mixed.csv"
    case_variant_csv(data)
    splits = load_splits(TrainConfig(data=str(data), merge_label_case=True))
    assert splits.labels == ["negative", "positive"]
    assert sum(len(s) for s in (splits.train, splits.val, splits.test)) == 120
    assert any("merged label 'Positive' (20 rows) into 'positive' (40 rows)" in n for n in splits.notes)
    assert any("stripped surrounding whitespace from label(s) ['Positive ']" in n for n in splits.notes)


def test_integer_labels_come_back_as_integers(tiny_models, tmp_path):
    """A JSONL file labelled 0/1: predictions came back as the strings "0"/"1". The run pins
    `label_type: int`; test_predictions.jsonl, eval and predict (JSON lines and CSV) write integers, and train
    says once that a prompt cannot read such names."""
    import json

    import yaml

    from tests.conftest import FAST, invoke

    table = toy_reviews(120)
    table["label"] = [int(x == "positive") for x in table["label"]]
    data = tmp_path / "ints.jsonl"
    table.to_json(data, orient="records", lines=True)
    out = tmp_path / "run"
    result = invoke("train", "--model", tiny_models["llama"], "--data", data, "--out", out, *FAST)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert said.count("carry no meaning a prompt can read") == 1 and "--verbalizers 0=" in said
    assert yaml.safe_load((out / "config.yaml").read_text())["label_type"] == "int"
    records = [json.loads(x) for x in (out / "test_predictions.jsonl").read_text().splitlines()]
    assert {type(r["gold"]) for r in records} == {int} and {type(r["predicted"]) for r in records} == {int}
    assert set(records[0]["probabilities"]) == {"0", "1"}  # JSON keys stay strings

    assert invoke("eval", out).exit_code == 0
    evaluated = [json.loads(x) for x in (out / "eval/test/predictions.jsonl").read_text().splitlines()]
    assert {type(r["gold"]) for r in evaluated} == {type(r["predicted"]) for r in evaluated} == {int}
    result = invoke("predict", out, "good story", "awful plot")
    assert result.exit_code == 0, result.output
    assert {type(json.loads(x)["label"]) for x in result.stdout.splitlines()} == {int}
    csv = tmp_path / "predictions.csv"
    assert invoke("predict", out, "good story", "awful plot", "--output", csv).exit_code == 0
    assert pd.read_csv(csv)["label"].isin([0, 1]).all()


def test_many_labels_are_shown_as_the_first_few_and_a_count():
    few = [f"l{n}" for n in range(10)]
    assert labels_line(few) == f"labels {few}"
    many = [f"intent_{n}" for n in range(77)]
    line = labels_line(many)
    assert line.startswith("77 labels: 'intent_0', 'intent_1'") and "'intent_7' and 69 more" in line
    assert "intent_8" not in line and len(line) < 200
