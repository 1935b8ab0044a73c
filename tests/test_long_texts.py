"""Texts longer than the window: `--long-texts mean|max` reads them in overlapping windows (`split_windows`)
and combines the windows' probabilities (`combine_windows`); shorter texts are read as before."""

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from loracls.data.tokenization import split_windows
from loracls.errors import LoraclsError
from loracls.inference.predict import Classifier, combine_windows
from tests.conftest import FAST, char_tokenizer, invoke, toy_reviews
from tests.test_serve import server


def test_a_long_text_becomes_overlapping_windows_that_end_at_its_end():
    tokenizer = char_tokenizer()
    windows, owner = split_windows(["abcdefghij", "xyz", "abcde"], tokenizer, 4, 2)
    assert windows == ["abcd", "cdef", "efgh", "ghij", "xyz", "abcd", "bcde"]  # the last ends at the end
    assert owner == [0, 0, 0, 0, 1, 2, 2]
    assert split_windows(["abcdefgh"], tokenizer, 4, 4)[0] == ["abcd", "efgh"]  # no overlap
    assert split_windows(["abcdefgh"], tokenizer, 4, 5)[0] == ["abcd", "efgh"]  # beyond a window: a window
    assert split_windows(["abcdefgh"], tokenizer, 4)[0] == ["abcd", "cdef", "efgh"]  # half a window
    with pytest.raises(LoraclsError, match="--stride must be at least 1, not 0"):
        split_windows(["abcdefgh"], tokenizer, 4, 0)


def test_windows_combine_by_their_mean_or_each_labels_highest():
    probs = np.array([[0.9, 0.1], [0.3, 0.7], [0.6, 0.4]])
    owner = np.array([0, 0, 1])
    assert np.allclose(combine_windows(probs, owner, "mean", True), [[0.6, 0.4], [0.6, 0.4]])
    assert np.allclose(combine_windows(probs, owner, "max", True), [[0.9 / 1.6, 0.7 / 1.6], [0.6, 0.4]])
    assert np.allclose(combine_windows(probs, owner, "max", False), [[0.9, 0.7], [0.6, 0.4]])  # per label


class Exclaims:
    """An objective that says `positive` exactly when the text read holds a "!" (one token of the tiny
    models' character tokenizer): what a window sees is plain."""

    def __init__(self, tokenizer):
        self.mark = tokenizer.convert_tokens_to_ids("!")

    def probs(self, model, batch):
        seen = (batch["input_ids"] == self.mark).any(1).float()
        return torch.stack([1 - seen, seen], 1)

    def classes(self, model):
        return 2


def test_a_mark_past_the_cut_is_read_in_windows_and_short_texts_answer_as_before(quick_run):
    classifier = Classifier.load(quick_run)
    assert classifier.max_length == 64 and classifier.labels == ["negative", "positive"]  # conftest FAST
    classifier.objective, classifier.temperature = Exclaims(classifier.tokenizer), 1.0
    texts = ["a short one!", "a short one", "the book was " * 12 + "great!", "the book was " * 12]
    cut = classifier.predict_probs(texts)
    assert cut[:, 1].tolist() == [1, 0, 0, 0]  # the long one's "!" is past the cut
    classifier.long_texts = "mean"
    windowed = classifier.predict_probs(texts)
    assert np.allclose(windowed[:2], cut[:2]) and windowed[3, 1] == 0  # short texts as before
    assert 0 < windowed[2, 1] < 1  # the last window sees it, the others do not
    classifier.long_texts, classifier.stride = "max", 8
    assert np.allclose(
        classifier.predict_probs(texts)[2], [0.5, 0.5]
    )  # both labels' highest is 1: renormalised
    classifier.long_texts, classifier.stride = "mean", 10_000  # beyond a window: windows side by side
    assert np.allclose(classifier.predict_probs(texts[:1]), cut[:1])
    with pytest.raises(LoraclsError, match="long texts are read as one of"):
        Classifier(classifier.model, classifier.tokenizer, classifier.labels, 64, long_texts="all")


def test_predict_and_eval_read_long_texts_in_windows(quick_run):
    result = invoke(
        "predict", quick_run, "the book was " * 12 + "great", "--long-texts", "max", "--stride", "16"
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1])["label"] in ("positive", "negative")
    result = invoke("eval", quick_run, "--long-texts", "mean")
    assert result.exit_code == 0, result.output
    assert (quick_run / "eval" / "test-windows-mean" / "metrics.json").is_file()
    result = invoke("predict", quick_run, "x", "--long-texts", "all")
    assert result.exit_code != 0 and "'all' is not one of" in result.output
    result = invoke("predict", quick_run, "x", "--stride", "8")  # the run cuts: a stride spaces nothing
    assert result.exit_code != 0 and "add --long-texts mean" in result.output


def windows_run(model: str, tmp_path) -> Path:
    """A tiny run of max_length 12 that validates and tests in windows (`long_texts: mean`)."""
    data = tmp_path / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    out = tmp_path / "run"
    args = ("--no-baseline", "--head-init", "zero", "--max-length", "12", "--long-texts", "mean")
    fast = [a for a in FAST if a not in ("--max-length", "64")]
    result = invoke("train", "--model", model, "--data", data, "--out", out, *fast, *args)
    assert result.exit_code == 0, result.output
    return out


def test_a_run_validates_and_tests_long_texts_in_windows_and_its_readers_follow(tiny_models, tmp_path):
    out = windows_run(tiny_models["llama"], tmp_path)
    metrics = json.loads((out / "metrics.json").read_text())
    test = (out / "data" / "test.jsonl").read_text().splitlines()
    assert metrics["test"]["n"] == len(test)  # a row per text, whatever its windows
    val = sorted((out / "val_predictions").glob("*.jsonl"))[-1].read_text().splitlines()
    assert len(val) == len((out / "data" / "val.jsonl").read_text().splitlines())
    classifier = Classifier.load(out)
    assert (classifier.long_texts, classifier.stride) == ("mean", None)  # predict reads as the run did
    scored = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    predicted = classifier.predict_probs([row["text"] for row in scored]).argmax(1)
    assert [classifier.labels[i] for i in predicted] == [row["predicted"] for row in scored]
    result = invoke("eval", out)
    assert result.exit_code == 0, result.output
    again = json.loads((out / "eval" / "test" / "metrics.json").read_text())
    assert again["accuracy"] == metrics["test"]["accuracy"]  # eval reproduces the run's windows
    assert invoke("eval", out, "--stride", "3").exit_code == 0  # the run's windows, 3 tokens apart
    assert (out / "eval" / "test-windows-mean-3" / "metrics.json").is_file()
    exported = tmp_path / "export"
    assert invoke("export", out, "--out", exported).exit_code == 0
    assert Classifier.load(exported).long_texts == "mean"


def test_serve_reads_long_texts_as_the_run_does(tiny_models, tmp_path):
    run = windows_run(tiny_models["qwen3"], tmp_path)
    texts = ["good", "the book was " * 6 + "great", "bad " * 9]
    classifier = Classifier.load(run)  # at the run's precision (bf16 on a CPU that computes it)
    assert classifier.temperature != 1.0  # applied once to a text, whatever its windows, as the run did:
    scored = [json.loads(line) for line in (run / "test_predictions.jsonl").read_text().splitlines()]
    again = classifier.predict_probs([row["text"] for row in scored])
    np.testing.assert_allclose(again, [list(row["probabilities"].values()) for row in scored], atol=1e-4)
    classifier.precision = "fp32"  # as the server below reads them
    windowed = classifier.predict_probs(texts)
    encoded = classifier.encode(texts, windows=True)
    assert len(encoded) > len(texts)  # the long ones are read in windows
    cut = Classifier.load(run)
    cut.precision = "fp32"
    assert cut.read_long_texts("cut", None)
    assert np.abs(cut.predict_probs(texts) - windowed).max() > 1e-4  # the windows change the answer
    with server(run, "--precision", "fp32") as (url, _):
        body = httpx.post(f"{url}/classify", json={"input": texts}).json()
    np.testing.assert_allclose([item["probs"] for item in body["data"]], windowed, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in encoded["input_ids"])  # every window
