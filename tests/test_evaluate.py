import json

import numpy as np
import pandas as pd
import pytest
import torch

from loracls.data.tokenization import tokenize
from loracls.model import load_classifier, load_tokenizer
from loracls.training.evaluate import (
    compute_metrics,
    describe_learning,
    learning_summary,
    predict_probs,
    write_predictions_jsonl,
)

LABELS = ["negative", "positive"]


def test_length_sorted_prediction_keeps_input_order(tiny_models):
    path = str(tiny_models["qwen3"])
    tokenizer = load_tokenizer(path)
    torch.manual_seed(1)
    model = load_classifier(path, LABELS, head_init="normal")  # a zero head would make every row equal
    model.config.pad_token_id = tokenizer.pad_token_id
    texts = [
        "a much longer text than the others here",
        "b",
        "medium text",
        "tiny",
        "the longest text of them all, by far",
    ]
    table = pd.DataFrame({"text": texts, "label": "negative"})
    dataset = tokenize(table, tokenizer, 64, {"negative": 0, "positive": 1})
    batched = predict_probs(model, dataset, tokenizer, batch_size=2)
    one_by_one = np.concatenate(
        [predict_probs(model, dataset.select([i]), tokenizer, 1) for i in range(len(texts))]
    )
    np.testing.assert_allclose(batched, one_by_one, atol=1e-5)
    assert len({tuple(np.round(p, 5)) for p in batched}) == len(texts)  # distinct rows: a shuffle would show

    # several batches under accelerate's autocast, as validation runs inside fit()
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # an earlier run's precision (bf16 where the CPU computes it) stays
    autocast = Accelerator(cpu=True, mixed_precision="no").autocast()
    np.testing.assert_allclose(
        predict_probs(model, dataset, tokenizer, 2, "cpu", autocast), batched, atol=1e-6
    )


def test_metrics_on_known_predictions():
    gold, pred = [0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, 1]
    m = compute_metrics(gold, pred, ["a", "b", "c"])
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["confusion_matrix"] == [[2, 1, 0], [0, 2, 0], [0, 1, 0]]
    assert m["per_class"]["a"]["recall"] == pytest.approx(2 / 3) and m["per_class"]["b"]["precision"] == 0.5
    assert m["per_class"]["c"]["f1-score"] == 0  # a class never predicted counts as 0, not as an error
    assert m["macro_f1"] == pytest.approx((0.8 + 2 / 3 + 0) / 3)
    assert m["pred_distribution"] == {"a": 2, "b": 4, "c": 0}


def test_prediction_file_has_one_complete_record_per_example(tmp_path):
    table = pd.DataFrame({"id": ["r1", "r2"], "text": ["好", "差"], "label": ["positive", "negative"]})
    path = tmp_path / "p.jsonl"
    write_predictions_jsonl(path, table, np.array([[0.2, 0.8], [0.9, 0.1]]), LABELS)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows[0] == {
        "id": "r1",
        "text": "好",
        "gold": "positive",
        "predicted": "positive",
        "probabilities": {"negative": 0.2, "positive": 0.8},
    }
    assert rows[1]["predicted"] == "negative"
    assert not list(tmp_path.glob("*.tmp"))


def evals(*values: float) -> list[dict]:
    """`train_log.jsonl` eval records every 10 steps, with a train record between (ignored)."""
    log = []
    for n, value in enumerate(values, 1):
        log += [{"kind": "train", "step": 10 * n - 5, "loss": 1.0}]
        log += [{"kind": "eval", "step": 10 * n, "val_macro_f1": value, "val_accuracy": 0.0, "best": False}]
    return log


TEST = compute_metrics([0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [0, 0, 0, 1, 0, 2, 2, 0, 0, 2], ["a", "b", "c"])


def test_learning_still_improving_when_the_best_validation_is_the_last():
    summary = learning_summary(evals(0.5, 0.6, 0.7), "macro_f1", 30, TEST)
    assert (summary["still_improving"], summary["best_step"], summary["last_macro_f1"]) == (True, 30, 0.7)
    lines = describe_learning(summary)
    assert "still improving at the last step (30, 3 validations)" in lines[0]


def test_learning_peaked_early_names_the_step_and_keeps_the_first_of_equal_values():
    summary = learning_summary(evals(0.7, 0.8, 0.8, 0.6, 0.5, 0.5, 0.5), "macro_f1", 70, TEST)
    assert (summary["still_improving"], summary["best_step"], summary["best_macro_f1"]) == (False, 20, 0.8)
    assert describe_learning(summary)[0].startswith("validation macro_f1 peaked at step 20 of 70")
    late = learning_summary(
        evals(0.5, 0.6, 0.8, 0.7), "macro_f1", 40, TEST
    )  # best at 30 of 40: nothing to say
    assert late["still_improving"] is False and len(describe_learning(late)) == 1


def test_one_validation_cannot_tell_and_the_weakest_class_is_by_recall():
    summary = learning_summary(evals(0.9), "macro_f1", 10, TEST)
    assert summary["still_improving"] is False
    assert summary["weakest_class"] == {"label": "b", "recall": 0.5, "support": 2.0}
    assert describe_learning(summary) == [
        "validated once: whether more steps would help is not known (--eval-every)",
        "weakest class on test: 'b' (recall 0.50, 2 examples)",
    ]
