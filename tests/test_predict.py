"""`Classifier` (`loracls.inference.predict`): a run's trained head restored, `loracls predict` on texts and
files (the input's columns kept), and the runs it refuses. Exports through predict are in test_export.py."""

import json

import pandas as pd
import torch
from safetensors.torch import load_file

from loracls.inference.predict import Classifier
from tests.conftest import invoke


def test_head_is_saved_and_restored(trained, tiny_models):
    run, _ = trained["gemma3"]
    saved = load_file(run / "best/adapter_model.safetensors")
    head_key = next(k for k in saved if "score" in k)
    classifier = Classifier.from_run(str(run))
    restored = classifier.model.score.weight.detach()
    torch.testing.assert_close(restored, saved[head_key])
    from loracls.model import load_classifier

    fresh = load_classifier(str(tiny_models["gemma3"]), ["negative", "positive"]).score.weight.detach()
    assert not torch.allclose(restored, fresh)  # the trained head, not the fresh (zero) one


def test_predict_texts_and_files(trained, tmp_path):
    run, _ = trained["gemma3"]
    result = invoke("predict", run, "good story", "awful plot")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["text"] for r in lines] == ["good story", "awful plot"]
    assert all(r["label"] in ("negative", "positive") for r in lines)

    source = tmp_path / "in.csv"
    pd.DataFrame({"text": ["love", "hate", "very good book indeed"]}).to_csv(source, index=False)
    out = tmp_path / "out.csv"
    assert invoke("predict", run, "--input", source, "--output", out).exit_code == 0
    table = pd.read_csv(out)
    assert list(table.columns) == ["text", "label", "p_negative", "p_positive"] and len(table) == 3
    expected = Classifier.from_run(str(run)).predict(["love", "hate", "very good book indeed"])
    assert list(table["label"]) == [r["label"] for r in expected]

    # the input's other columns come through, so that results join back; a gold `label` column stays the
    # user's and the prediction is `label_predicted`
    source = tmp_path / "orders.csv"
    orders = pd.DataFrame(
        {"order_id": [17, 4, 9], "text": ["love", "hate", "very good book indeed"], "label": ["a", "b", "c"]}
    )
    orders.to_csv(source, index=False)
    assert invoke("predict", run, "--input", source, "--output", out).exit_code == 0
    table = pd.read_csv(out)
    assert list(table.columns) == ["order_id", "label", "text", "label_predicted", "p_negative", "p_positive"]
    assert list(table["order_id"]) == [17, 4, 9] and list(table["label"]) == ["a", "b", "c"]
    assert list(table["label_predicted"]) == [r["label"] for r in expected]
    result = invoke("predict", run, "--input", source)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["order_id"], r["label"], r["label_predicted"]) for r in lines] == [  # a CSV cell: as written
        ("17", "a", expected[0]["label"]),
        ("4", "b", expected[1]["label"]),
        ("9", "c", expected[2]["label"]),
    ]


def test_unfinished_run_is_refused(trained, tmp_path):
    run, _ = trained["gemma3"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "status.json").write_text(json.dumps({"state": "running"}))
    result = invoke("eval", broken)
    assert result.exit_code == 2 and "did not finish (status: running)" in result.output
    result = invoke("predict", run)
    assert result.exit_code == 2 and "one of the two" in result.output
