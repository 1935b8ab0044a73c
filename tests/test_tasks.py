"""Beyond binary sentiment: 3 classes, multi-label (sigmoid, thresholds, metrics, predict, export), class
imbalance and class-weighted loss."""

from __future__ import annotations

import json
import random

import numpy as np
import pandas as pd
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification

from loracls.config import TrainConfig
from loracls.data.splits import load_splits
from loracls.data.tables import read_labelled
from loracls.objective import ClassificationHead
from loracls.training.evaluate import compute_multilabel_metrics, tune_thresholds
from tests.conftest import FAST, invoke

TOPICS = {
    "sport": ["ball", "goal", "team"],
    "music": ["song", "band", "tune"],
    "food": ["rice", "soup", "cake"],
}


def loss_fn(cfg: TrainConfig, train_set: Dataset) -> torch.nn.Module:
    return ClassificationHead.weighted(cfg, train_set, 2, torch.device("cpu")).loss_fn


def topics(n: int, seed: int = 0) -> pd.DataFrame:
    """Each text mentions some of three topics (possibly none); its labels are exactly those topics."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        chosen = sorted(t for t in TOPICS if rng.random() < 0.4)
        words = [rng.choice(TOPICS[t]) for t in chosen] + rng.sample(["the", "a", "it", "was", "and"], 3)
        rng.shuffle(words)
        rows.append({"text": " ".join(words) + f" #{i}", "label": ",".join(chosen)})
    return pd.DataFrame(rows)


def test_three_classes_train_and_report(tmp_path, tiny_models):
    rng = random.Random(1)
    words = {"positive": "good", "negative": "bad", "neutral": "okay"}
    rows = [
        {"text": f"{rng.choice(['the', 'a'])} {words[label]} film #{i}", "label": label}
        for i, label in enumerate(list(words) * 50)
    ]
    data = tmp_path / "three.csv"
    pd.DataFrame(rows).to_csv(data, index=False)
    out = tmp_path / "run"
    result = invoke("train", "--model", tiny_models["qwen3"], "--data", data, "--out", out, *FAST)
    assert result.exit_code == 0, result.output
    test = json.loads((out / "metrics.json").read_text())["test"]
    assert list(test["per_class"]) == ["negative", "neutral", "positive"]
    assert np.asarray(test["confusion_matrix"]).shape == (3, 3) and test["n"] == 15  # 10% of 150
    assert {"accuracy", "macro_f1", "weighted_f1"} <= set(test)
    result = invoke("predict", out, "a good film")
    assert json.loads(result.stdout)["label"] in words


def test_multi_label_data_reads_lists_and_separators(tmp_path):
    csv, jsonl = tmp_path / "d.csv", tmp_path / "d.jsonl"
    pd.DataFrame({"text": ["a", "b", "c"], "label": ["music|sport", "", "food"]}).to_csv(csv, index=False)
    jsonl.write_text('{"text": "a", "label": ["sport", "music"]}\n{"text": "b", "label": []}\n')
    assert list(read_labelled(str(csv), "text", "label", "|")["label"]) == [("music", "sport"), (), ("food",)]
    assert list(read_labelled(str(jsonl), "text", "label", ",")["label"]) == [("music", "sport"), ()]


def test_tuned_thresholds_maximise_f1_per_label():
    table = pd.DataFrame({"label": [("a",), ("a",), (), ("b",), ()]})
    probs = np.array([[0.9, 0.1], [0.3, 0.2], [0.2, 0.1], [0.1, 0.35], [0.1, 0.3]])
    thresholds = tune_thresholds(table, probs, ["a", "b"])
    # a: any threshold in (0.2, 0.3] catches both positives and no negative; the one nearest 0.5 wins
    assert thresholds[0] == pytest.approx(0.3)
    assert thresholds[1] == pytest.approx(0.35)  # above 0.3 (the negative), at most 0.35 (the positive)


def test_multi_label_metrics():
    gold = np.array([[1, 0], [1, 1], [0, 0]])
    pred = np.array([[1, 0], [1, 0], [0, 1]])
    metrics = compute_multilabel_metrics(gold, pred, ["a", "b"])
    assert metrics["subset_accuracy"] == pytest.approx(1 / 3) == metrics["accuracy"]
    assert metrics["per_class"]["a"]["f1-score"] == 1.0 and metrics["per_class"]["b"]["f1-score"] == 0.0
    assert metrics["macro_f1"] == pytest.approx(0.5)
    assert metrics["micro_f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))  # tp 2, fp 1, fn 1
    assert metrics["label_confusion"]["b"] == [[1, 1], [1, 0]]


def test_multi_label_trains_tunes_thresholds_predicts_and_exports(tmp_path, tiny_models):
    data = tmp_path / "topics.csv"
    topics(150).to_csv(data, index=False)
    out = tmp_path / "run"
    result = invoke(
        "train", "--model", tiny_models["llama"], "--data", data, "--out", out, "--multi-label", *FAST
    )
    assert result.exit_code == 0, result.output
    assert "prompt baseline scores single-label tasks only" in " ".join(result.output.split())
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["loss"] == pytest.approx(np.log(2), abs=0.05)  # sigmoid + BCE from a zero head
    metrics = json.loads((out / "metrics.json").read_text())
    test = metrics["test"]
    assert {"subset_accuracy", "micro_f1", "macro_f1", "label_confusion"} <= set(test)
    assert list(test["per_class"]) == ["food", "music", "sport"]
    thresholds = json.loads((out / "thresholds.json").read_text())
    assert set(thresholds) == {"food", "music", "sport"}
    assert all(0.05 <= t <= 0.95 for t in thresholds.values())
    first = json.loads((out / "test_predictions.jsonl").read_text().splitlines()[0])
    assert isinstance(first["gold"], list) and isinstance(first["predicted"], list)
    assert all(first["probabilities"][name] >= thresholds[name] for name in first["predicted"])
    assert (out / "report.html").is_file()

    result = invoke("predict", out, "ball song the a")
    record = json.loads(result.stdout)
    assert "label" not in record and set(record["labels"]) <= set(thresholds)
    assert invoke("eval", out).exit_code == 0
    assert json.loads((out / "eval/test/metrics.json").read_text())["micro_f1"] == test["micro_f1"]

    result = invoke("export", out, "--out", tmp_path / "export")
    assert result.exit_code == 0, result.output
    info = json.loads((tmp_path / "export/loracls.json").read_text())
    assert info["thresholds"] == [thresholds[name] for name in info["labels"]]
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export")
    assert plain.config.problem_type == "multi_label_classification"
    again = json.loads(invoke("predict", tmp_path / "export", "ball song the a").stdout)
    assert again["labels"] == record["labels"]

    result = invoke("predict", out, "ball song the a", "--int8")  # int8 compares label sets with fp32's
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert json.loads(lines[0])["labels"] == record["labels"]
    check = json.loads((out / "int8/parity.json").read_text())
    assert check["passed"] and check["texts"] == len((out / "data/test.jsonl").read_text().splitlines())


def test_class_imbalance_is_reported_and_weighted(tmp_path):
    path = tmp_path / "skewed.csv"
    rows = [{"text": f"text {i}", "label": "rare" if i % 10 == 0 else "common"} for i in range(200)]
    pd.DataFrame(rows).to_csv(path, index=False)
    splits = load_splits(TrainConfig(data=str(path)))
    assert any(n.startswith("class imbalance in train: {'common': 144, 'rare': 16}") for n in splits.notes)

    single = Dataset.from_dict({"labels": [0] * 90 + [1] * 10})
    weights = loss_fn(TrainConfig(class_weights=True), single).weight
    assert weights.tolist() == pytest.approx([100 / 180, 100 / 20])
    assert loss_fn(TrainConfig(), single).weight is None
    multi = Dataset.from_dict({"labels": [[1.0, 0.0]] * 3 + [[1.0, 1.0]]})
    loss = loss_fn(TrainConfig(multi_label=True, class_weights=True), multi)
    assert isinstance(loss, torch.nn.BCEWithLogitsLoss) and loss.pos_weight.tolist() == [0.25, 3.0]
