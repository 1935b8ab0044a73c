"""`Classifier` (`loracls.inference.predict`): a run's trained head restored, `loracls predict` on texts and
files (the input's columns kept), the runs it refuses, and the progress `predict` and `eval` show. Exports
through predict are in test_export.py."""

import json
import re
import shutil
import signal

import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file

from loracls.inference.predict import Classifier, evaluate_run
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


def test_a_qlora_run_on_a_machine_without_a_gpu_runs_on_the_full_precision_base(
    quick_run, tmp_path, capsys, monkeypatch
):
    """bitsandbytes' 4-bit layers need a GPU: a QLoRA run read on a CPU says so and answers as its export
    would (merged into the full-precision base), instead of torch's `current_device()` RuntimeError."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # on a GPU machine too
    qlora = tmp_path / "qlora"
    shutil.copytree(quick_run, qlora)
    config = yaml.safe_load((qlora / "config.yaml").read_text())
    (qlora / "config.yaml").write_text(yaml.safe_dump({**config, "quantize": "4bit"}, sort_keys=False))
    texts = ["good story", "awful plot", "love it"]
    answers = Classifier.from_run(str(qlora)).predict(texts)
    said = " ".join(capsys.readouterr().err.split())
    assert "trained LoRA on a 4-bit base (QLoRA)" in said and "full-precision base" in said, said
    expected = Classifier.from_run(str(quick_run)).predict(texts)
    assert [a["label"] for a in answers] == [e["label"] for e in expected]


def test_unfinished_run_is_refused(trained, tmp_path):
    run, _ = trained["gemma3"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "status.json").write_text(json.dumps({"state": "running"}))
    result = invoke("eval", broken)
    assert result.exit_code == 2 and "did not finish (status: running)" in result.output
    result = invoke("predict", run)
    assert result.exit_code == 2 and "one of the two" in result.output


def test_predict_shows_its_progress_on_a_terminal_and_keeps_stdout_for_results(quick_run, terminal):
    result = invoke("predict", quick_run, "good story", "awful plot", "love")
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["text"] for line in result.stdout.splitlines()] == [
        "good story",
        "awful plot",
        "love",
    ]
    assert re.search(r"predict .*3/3 examples", terminal.getvalue()), terminal.getvalue()


def test_eval_prints_plain_lines_to_a_log(quick_run, log_file):
    metrics, _ = evaluate_run(quick_run)
    n = metrics["n"]
    assert re.search(rf"^eval: {n} of {n} examples, done in \d+ s$", log_file.getvalue(), re.M), (
        log_file.getvalue()
    )


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_predict_says_where_and_writes_nothing(quick_run, tmp_path, number):
    """A real SIGINT (Ctrl-C) or SIGTERM (`kill`) during the first batch: exit 130 with where it stopped,
    instead of click's `Aborted!` or a silent exit."""
    from tests.test_runs import signal_during

    out = tmp_path / "predictions.jsonl"
    args = ["predict", quick_run, "good story", "awful plot", "--output", out]
    code, stderr = signal_during("ClassificationHead.probs", number, args, tmp_path, "loracls.objective")
    assert code == 130 and "Traceback" not in stderr and "Aborted" not in stderr
    assert "interrupted during predict: 0 of 2 examples; nothing was written" in stderr
    assert not out.exists()
