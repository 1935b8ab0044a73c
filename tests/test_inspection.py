"""`loracls data inspect`: what it reports of a data set before training."""

import json

import pandas as pd

from loracls import model
from tests.conftest import invoke, write_tiny_gguf
from tests.test_labels import case_variant_csv


def test_inspect_reports_duplicates_leakage_rare_labels_and_lengths(tmp_path, tiny_models):
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


def test_inspect_reports_labels_that_differ_only_in_case(tmp_path):
    data = tmp_path / "mixed.csv"
    case_variant_csv(data)
    result = invoke("data", "inspect", data, "--json")
    assert result.exit_code == 0, result.output
    findings = "\n".join(json.loads(result.stdout)["findings"])
    assert "'Positive' (20 rows) and 'positive' (40 rows) differ only in case" in findings
    assert "surrounding whitespace" in findings


def test_inspect_counts_tokens_of_a_packaged_gguf_model_without_converting_it(tmp_path, monkeypatch):
    """With an empty cache, `data inspect --model gemma3-270m` converted the whole model (a minute, a gigabyte
    of float32 weights on disk) to count tokens: the tokenizer inside the GGUF file is enough."""
    monkeypatch.setenv("LORACLS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model, "packaged_gguf", lambda alias: write_tiny_gguf(tmp_path / "gemma.gguf"))

    def convert_gguf(*args):
        raise AssertionError("the model was converted to count tokens")

    monkeypatch.setattr(model, "convert_gguf", convert_gguf)
    data = tmp_path / "d.csv"
    pd.DataFrame({"text": ["hello world", "abc", "hi"], "label": ["a", "b", "a"]}).to_csv(data, index=False)
    result = invoke("data", "inspect", data, "--model", "gemma3-270m", "--max-length", "8", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["splits"]["data"]
    # <s>, then one token per letter, each word after a "\u2581": 13 for "hello world", 5 for "abc"
    assert report["tokens"] == {"p50": 5, "max": 13} and report["truncated_share"] == 1 / 3
    assert not (tmp_path / "cache" / "models").exists()
