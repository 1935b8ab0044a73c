"""Temperature scaling (`training/calibration.py`): a known over-confidence is found and undone without
moving a label, and a run's temperature reaches every reading of it (eval, predict, the exports)."""

import json

import numpy as np
import pandas as pd
import pytest
from scipy.special import softmax
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

from loracls.errors import LoraclsError
from loracls.inference.predict import Classifier, check_min_confidence
from loracls.training.calibration import abstains, coverage, fit_temperature, reliability, with_temperature
from tests.conftest import FAST, invoke, toy_reviews


def test_a_known_overconfidence_is_found_and_undone_without_moving_a_label():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, size=(4000, 4))
    gold = np.array([rng.choice(4, p=p) for p in softmax(logits, axis=-1)])  # labels drawn from softmax(z)
    overconfident = softmax(3.0 * logits, axis=-1)  # a model whose logits are 3x too large
    temperature = fit_temperature(overconfident, gold)
    assert temperature == pytest.approx(3.0, rel=0.1)
    calibrated = with_temperature(overconfident, temperature)
    assert (calibrated.argmax(-1) == overconfident.argmax(-1)).all()
    np.testing.assert_allclose(calibrated.sum(-1), 1.0, atol=1e-5)
    before, after = reliability(overconfident, gold)["ece"], reliability(calibrated, gold)["ece"]
    assert before > 0.1 and after < 0.03, (before, after)
    assert with_temperature(overconfident, 1.0) is overconfident


def test_the_ece_is_the_weighted_gap_of_the_bins():
    probs = np.array([[0.95, 0.05], [0.95, 0.05], [0.6, 0.4], [0.6, 0.4]])
    gold = np.array([0, 1, 0, 0])  # confidence 0.95 right half the time; 0.6 always right
    table = reliability(probs, gold)
    assert table["ece"] == pytest.approx(0.5 * 0.45 + 0.5 * 0.4)
    assert [b["n"] for b in table["bins"]] == [2, 2]


def test_coverage_counts_the_texts_at_or_above_each_level_and_their_accuracy():
    probs = np.array([[0.9, 0.1], [0.3, 0.7], [0.55, 0.45], [0.2, 0.8]])
    gold = np.array([0, 0, 0, 1])  # right, wrong (0.7), right (0.55), right (0.8)
    assert abstains(probs, 0.7).tolist() == [False, False, True, False]  # 0.7 itself keeps its label
    assert not abstains(probs, None).any()
    rows = {r["min_confidence"]: r for r in coverage(probs, gold, (0.0, 0.6, 0.75, 0.95))}
    assert rows[0.0] == {"min_confidence": 0.0, "coverage": 1.0, "accuracy": 0.75}
    assert rows[0.6]["coverage"] == 0.75 and rows[0.6]["accuracy"] == pytest.approx(2 / 3)
    assert rows[0.75]["coverage"] == 0.5 and rows[0.75]["accuracy"] == 1.0
    assert rows[0.95] == {"min_confidence": 0.95, "coverage": 0.0, "accuracy": None}


def test_min_confidence_is_a_probability_of_a_single_label_classifier():
    check_min_confidence(None, True)
    check_min_confidence(0.8, False)
    with pytest.raises(LoraclsError, match="between 0 and 1, not 1.5"):
        check_min_confidence(1.5, False)
    with pytest.raises(LoraclsError, match="own threshold"):
        check_min_confidence(0.8, True)


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("calibration")
    data = root / "reviews.csv"
    toy_reviews(160).to_csv(data, index=False)
    result = invoke("train", "--model", tiny_models["llama"], "--data", data, "--out", root / "run", *FAST)
    assert result.exit_code == 0, result.output
    return root / "run"


def test_a_run_fits_its_temperature_and_every_reading_applies_it(run, tmp_path):
    temperature = json.loads((run / "temperature.json").read_text())["temperature"]
    calibration = json.loads((run / "metrics.json").read_text())["calibration"]
    assert calibration["temperature"] == temperature != 1.0
    assert {"ece_before", "ece_after", "bins_before", "bins_after"} <= set(calibration)
    saved = [json.loads(line) for line in (run / "test_predictions.jsonl").read_text().splitlines()]
    texts = [r["text"] for r in saved]
    classifier = Classifier.load(run)
    classifier.precision = "fp32"
    assert classifier.temperature == temperature
    probs = classifier.predict_probs(texts)
    labels = classifier.labels
    np.testing.assert_allclose(probs, [[r["probabilities"][k] for k in labels] for r in saved], atol=2e-3)
    for args in ([], ["--adapter-only"]):
        out = tmp_path / ("adapter" if args else "merged")
        assert invoke("export", run, "--out", out, *args).exit_code == 0
        info = json.loads((out / "loracls.json").read_text())
        assert info["temperature"] == temperature and info["temperature_in_head"] is not bool(args)
        exported = Classifier.load(out)
        exported.precision = "fp32"
        np.testing.assert_allclose(exported.predict_probs(texts), probs, atol=1e-4)
    # plain transformers reads the merged export's head, the temperature folded into it
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    classify = pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None, device="cpu")
    if classifier.prompter is None:  # raw texts in: the same probabilities
        theirs = [{x["label"]: x["score"] for x in t} for t in classify(texts[:8])]
        np.testing.assert_allclose([[t[k] for k in labels] for t in theirs], probs[:8], atol=1e-4)


def test_temperature_scaling_off_leaves_the_probabilities_as_trained(tiny_models, tmp_path):
    data = tmp_path / "reviews.csv"
    toy_reviews(80).to_csv(data, index=False)
    args = ("--no-temperature-scaling", "--no-baseline", "--head-init", "zero")
    result = invoke(
        "train", "--model", tiny_models["llama"], "--data", data, "--out", tmp_path / "run", *FAST, *args
    )
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "run/temperature.json").exists()
    assert json.loads((tmp_path / "run/metrics.json").read_text())["calibration"] is None
    assert Classifier.load(tmp_path / "run").temperature == 1.0


def test_predict_abstains_below_min_confidence_as_the_runs_coverage_says(run, tmp_path):
    metrics = json.loads((run / "metrics.json").read_text())["test"]
    rows = metrics["coverage"]
    assert rows[0] == {"min_confidence": 0.0, "coverage": 1.0, "accuracy": pytest.approx(metrics["accuracy"])}
    shares = [r["coverage"] for r in rows]
    assert shares == sorted(shares, reverse=True)  # a higher floor keeps fewer
    saved = [json.loads(line) for line in (run / "test_predictions.jsonl").read_text().splitlines()]
    tops = sorted(max(r["probabilities"].values()) for r in saved)
    level = (tops[len(tops) // 2 - 1] + tops[len(tops) // 2]) / 2
    texts = tmp_path / "texts.csv"
    pd.DataFrame({"id": range(len(saved)), "text": [r["text"] for r in saved]}).to_csv(texts, index=False)
    out = tmp_path / "out.csv"
    result = invoke("predict", run, "--input", texts, "--output", out, "--min-confidence", f"{level:.6f}")
    assert result.exit_code == 0, result.output
    written = pd.read_csv(out)
    unsure = written["abstained"].to_numpy()
    assert 0 < unsure.sum() < len(saved) and f"{unsure.sum()} of {len(saved)} texts below" in result.output
    assert written["label"][unsure].isna().all() and written["label"][~unsure].notna().all()
    top = written[[c for c in written.columns if c.startswith("p_")]].max(axis=1).to_numpy()
    assert (top[unsure] < level).all() and (top[~unsure] >= level).all()
    evaluated = invoke("eval", run)
    assert evaluated.exit_code == 0, evaluated.output
    again = json.loads((run / "eval" / "test" / "metrics.json").read_text())["coverage"]
    assert [r["min_confidence"] for r in again] == [r["min_confidence"] for r in rows]
    assert again[0]["coverage"] == 1.0
    refused = invoke("predict", run, "good", "--min-confidence", "2")
    assert refused.exit_code != 0 and "min-confidence" in refused.output
