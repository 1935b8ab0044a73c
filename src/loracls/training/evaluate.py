"""Predict in length-sorted batches, put predictions back in input order, and score them with sklearn; a run's
validation (`evaluation_probs`, `score_validation`: what `fit()` and the final test call)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from datasets import Dataset
from sklearn.metrics import (
    accuracy_score,
    classification_report,
    confusion_matrix,
    f1_score,
    multilabel_confusion_matrix,
)
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase

from loracls.config import TrainConfig
from loracls.console import progress
from loracls.data.batching import LengthGroupedBatches
from loracls.data.labels import label_ids, label_value
from loracls.data.splits import Splits
from loracls.environment.micro_batch import eval_batch_size
from loracls.files import write_text
from loracls.objective import ClassificationHead, Objective
from loracls.training.calibration import calibrate, coverage
from loracls.training.runs import RunFolder


@torch.inference_mode()
def predict_probs(
    model: torch.nn.Module,
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    device: torch.device | str | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
    accelerator: Accelerator | None = None,
    objective: Objective | None = None,
    stage: str | None = None,
    max_tokens: int | None = None,
) -> np.ndarray:
    """Class probabilities, shape (examples, classes), in the dataset's order, from `objective.probs`
    (default: the model's classification head: softmax, or a sigmoid per label for multi-label). Under several
    processes (`accelerator`), each scores every n-th batch and all receive the whole result: every example is
    scored exactly once, with no padding of the last batch to gather. Every process runs the same number of
    forward passes (a short one runs a discarded extra), as a sharded model needs. `stage`: the name of the
    progress bar it shows (None: none; a server's batches show none). Passes hold at most `batch_size` texts
    and, with `max_tokens`, at most that many padded tokens (`length_passes`).
    """
    inputs = dataset.select_columns(["input_ids"])
    lengths = [len(x) for x in inputs["input_ids"]]
    batches = LengthGroupedBatches(lengths, batch_size, shuffle=False, max_tokens=max_tokens).batches()
    rounds, spare = len(batches), batches[0][:1] if batches else []
    if accelerator is not None and accelerator.num_processes > 1:
        rounds = -(-len(batches) // accelerator.num_processes)  # forward passes per process, all equal
        batches = batches[accelerator.process_index :: accelerator.num_processes]
    collate = DataCollatorWithPadding(tokenizer)
    loader = DataLoader(inputs, batch_sampler=batches, collate_fn=collate)
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    objective = objective or ClassificationHead.for_model(model)
    probs = np.zeros((len(dataset), objective.classes(model)), dtype=np.float32)
    shown = progress(stage, sum(map(len, batches)), "examples")
    with autocast or contextlib.nullcontext(), shown as bar:  # autocast once: accelerate's is single-use
        for indices, batch in zip(batches, loader, strict=True):
            probs[indices] = objective.probs(model, {k: v.to(device) for k, v in batch.items()}).cpu().numpy()
            bar.advance(len(indices))
        for _ in range(rounds - len(batches)):
            # a sharded model (FSDP) needs every process in every forward pass: one example, discarded
            model(**{k: v.to(device) for k, v in collate([inputs[i] for i in spare]).items()})
    model.train(was_training)
    if accelerator is not None and accelerator.num_processes > 1:
        gather_rows(probs, np.concatenate(batches) if batches else np.zeros(0, dtype=int))
    return probs


def gather_rows(table: np.ndarray, mine: np.ndarray) -> np.ndarray:
    """Sharded scoring's end: each process filled the rows `mine` of `table` (its share); afterwards every
    process holds every process's rows, in place."""
    for rows, part in gather_object([(mine, table[mine])]):
        table[rows] = part
    return table


def compute_metrics(gold: list[int], pred: list[int], labels: list[str]) -> dict:
    """Accuracy, macro and weighted F1, per-class precision/recall/F1 and the confusion matrix."""
    ids = list(range(len(labels)))
    report = classification_report(
        gold, pred, labels=ids, target_names=labels, output_dict=True, zero_division=0
    )
    return {
        "accuracy": float(accuracy_score(gold, pred)),
        "macro_f1": float(f1_score(gold, pred, labels=ids, average="macro", zero_division=0)),
        "weighted_f1": float(f1_score(gold, pred, labels=ids, average="weighted", zero_division=0)),
        "per_class": {name: {k: float(v) for k, v in report[name].items()} for name in labels},
        "confusion_matrix": confusion_matrix(gold, pred, labels=ids).tolist(),
        "pred_distribution": {name: int(np.sum(np.asarray(pred) == i)) for i, name in enumerate(labels)},
        "n": len(gold),
    }


def compute_multilabel_metrics(gold: np.ndarray, pred: np.ndarray, labels: list[str]) -> dict:
    """Subset accuracy (as `accuracy`), micro/macro/weighted F1, per-label precision/recall/F1 and 2x2
    confusion matrices, from 0/1 indicator matrices of shape (examples, labels)."""
    report = classification_report(gold, pred, target_names=labels, output_dict=True, zero_division=0)
    return {
        "accuracy": float(accuracy_score(gold, pred)),
        "subset_accuracy": float(accuracy_score(gold, pred)),
        **{
            f"{average}_f1": float(f1_score(gold, pred, average=average, zero_division=0))
            for average in ("micro", "macro", "weighted")
        },
        "per_class": {name: {k: float(v) for k, v in report[name].items()} for name in labels},
        "label_confusion": {
            name: m.tolist() for name, m in zip(labels, multilabel_confusion_matrix(gold, pred), strict=True)
        },
        "pred_distribution": {name: int(n) for name, n in zip(labels, pred.sum(axis=0), strict=True)},
        "n": len(gold),
    }


def label_matrix(table: pd.DataFrame, labels: list[str]) -> np.ndarray:
    """The multi-label gold labels as a 0/1 matrix (examples, labels)."""
    return np.array([[name in names for name in labels] for names in table["label"]], dtype=int).reshape(
        len(table), len(labels)
    )


def tune_thresholds(table: pd.DataFrame, probs: np.ndarray, labels: list[str]) -> np.ndarray:
    """Per label, the threshold in 0.05..0.95 with the best F1 on these (validation) examples; ties go to the
    one nearest 0.5, and a label with no positive example keeps 0.5."""
    gold = label_matrix(table, labels)
    grid = np.round(np.arange(0.05, 0.951, 0.05), 2)
    best = np.full(len(labels), 0.5)
    for k in range(len(labels)):
        if gold[:, k].any():
            scores = [(f1_score(gold[:, k], probs[:, k] >= t, zero_division=0), -abs(t - 0.5)) for t in grid]
            best[k] = grid[max(range(len(grid)), key=scores.__getitem__)]
    return best


def write_predictions_jsonl(
    path: Path,
    table: pd.DataFrame,
    probs: np.ndarray,
    labels: list[str],
    extra: dict[str, np.ndarray] | None = None,
    thresholds: np.ndarray | None = None,
    label_type: str = "str",
) -> None:
    """One JSON object per example: id, text, gold (when known), predicted label and every probability.

    With `thresholds` (multi-label), `gold` and `predicted` are lists: every label at or above its threshold.
    `extra` adds further per-label score arrays under their own names (the baseline's log-probabilities).
    `label_type` `int`: `gold` and `predicted` are integers (the probabilities' keys stay strings).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    predicted = predicted_labels(probs, labels, thresholds)
    lines = []
    for i, (row, p) in enumerate(zip(table.itertuples(index=False), probs, strict=True)):
        record = {"id": str(row.id), "text": row.text}
        if "label" in table.columns:
            record["gold"] = label_value(list(row.label) if thresholds is not None else row.label, label_type)
        record["predicted"] = label_value(predicted[i], label_type)
        record["probabilities"] = rounded(p, labels)
        for key, values in (extra or {}).items():
            record[key] = rounded(values[i], labels)
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    write_text(path, "".join(lines))


def predicted_labels(
    probs: np.ndarray, labels: list[str], thresholds: np.ndarray | list[float] | None = None
) -> list:
    """Each row's predicted label (the most probable), or with `thresholds` (multi-label) the list of every
    label whose probability reaches its threshold."""
    if thresholds is None:
        return [labels[int(i)] for i in np.asarray(probs).argmax(-1)]
    chosen = np.asarray(probs) >= np.asarray(thresholds)[None, :]
    return [[name for name, on in zip(labels, row, strict=True) if on] for row in chosen]


def rounded(probs: np.ndarray, labels: list[str]) -> dict[str, float]:
    """One row of probabilities as {label: probability}, rounded to 6 digits for output files."""
    return {name: round(float(x), 6) for name, x in zip(labels, probs, strict=True)}


def score(
    table: pd.DataFrame, probs: np.ndarray, labels: list[str], thresholds: np.ndarray | None = None
) -> dict:
    """Metrics of `probs` against the table's labels; with `thresholds`, as a multi-label task."""
    if thresholds is not None:
        predicted = (probs >= thresholds).astype(int)
        return compute_multilabel_metrics(label_matrix(table, labels), predicted, labels)
    label2id = label_ids(labels)
    return compute_metrics([label2id[x] for x in table["label"]], probs.argmax(-1).tolist(), labels)


def score_test(
    table: pd.DataFrame, probs: np.ndarray, labels: list[str], thresholds: np.ndarray | None = None
) -> dict:
    """`score`, and for a single-label task `coverage`: the share of texts answered and their accuracy at
    each `--min-confidence` level (`calibration.coverage`)."""
    metrics = score(table, probs, labels, thresholds)
    if thresholds is None:
        label2id = label_ids(labels)
        metrics["coverage"] = coverage(probs, np.array([label2id[x] for x in table["label"]]))
    return metrics


def learning_summary(log: list[dict], metric: str, steps: int, test: dict) -> dict:
    """How the run learned, from its validations (`train_log.jsonl`'s `eval` records) and the test metrics:
    whether validation was still improving at the end (the best validation is the last of two or more:
    more steps may help), or peaked early, and the test's weakest class by recall."""
    values = [(r["step"], r[f"val_{metric}"]) for r in log if r.get("kind") == "eval"]
    summary: dict = {"metric": metric, "validations": len(values), "steps": steps}
    if values:
        best_step, best = max(values, key=lambda pair: pair[1])  # the first of equal values, as fit() keeps
        last_step, last = values[-1]
        summary |= {"best_step": best_step, f"best_{metric}": best, f"last_{metric}": last}
        summary["still_improving"] = len(values) >= 2 and best_step == last_step
    weakest = min(test["per_class"].items(), key=lambda item: (item[1]["recall"], item[1]["support"]))
    summary["weakest_class"] = {"label": weakest[0], **{k: weakest[1][k] for k in ("recall", "support")}}
    return summary


def describe_learning(summary: dict) -> list[str]:
    """`learning_summary` in words, for the end of `loracls train`."""
    lines, metric = [], summary["metric"]
    n, best = summary["validations"], summary.get("best_step")
    if n < 2:
        lines.append("validated once: whether more steps would help is not known (--eval-every)")
    elif summary["still_improving"]:
        lines.append(
            f"validation {metric} was still improving at the last step ({best}, {n} validations): more steps "
            "may help (--epochs, --min-steps)"
        )
    elif best < summary["steps"] / 2:
        lines.append(
            f"validation {metric} peaked at step {best} of {summary['steps']} "
            f"({summary[f'best_{metric}']:.4f}, last {summary[f'last_{metric}']:.4f}): the best step is "
            "kept; fewer steps would do"
        )
    weakest = summary["weakest_class"]
    lines.append(
        f"weakest class on test: {weakest['label']!r} (recall {weakest['recall']:.2f}, "
        f"{int(weakest['support'])} examples)"
    )
    return lines


def combine_windows(probs: np.ndarray, owner: np.ndarray, how: str, single_label: bool) -> np.ndarray:
    """Each text's probabilities from its windows' (`owner`: the text of each window, every text from 0 on
    with one at least): their mean, or each label's highest (`max`; single-label: renormalised to sum to
    1)."""
    texts = int(owner.max()) + 1 if len(owner) else 0
    combined = np.zeros((texts, probs.shape[1]), dtype=probs.dtype)
    if how == "mean":
        np.add.at(combined, owner, probs)
        return combined / np.bincount(owner, minlength=texts)[:, None]
    np.maximum.at(combined, owner, probs)
    return combined / combined.sum(1, keepdims=True) if single_label else combined


def evaluation_probs(
    model: torch.nn.Module,
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    cfg: TrainConfig,
    accelerator: Accelerator,
    objective: Objective,
    stage: str | None = None,
) -> np.ndarray:
    """`predict_probs` as a run evaluates: batches of twice the micro-batch, shared by the processes; a
    dataset of windows (`owner`: `tokenize`'s `long_texts`) gives each text's, as `cfg.long_texts` combines
    them."""
    probs = predict_probs(
        model,
        dataset,
        tokenizer,
        eval_batch_size(cfg.micro_batch_size),
        accelerator.device,
        accelerator.autocast(),
        accelerator,
        objective,
        stage,
    )
    if "owner" not in dataset.column_names:
        return probs
    return combine_windows(probs, np.array(dataset["owner"]), cfg.long_texts, not cfg.multi_label)


def score_validation(probs: np.ndarray, splits: Splits, cfg: TrainConfig, run: RunFolder, step: int) -> dict:
    """Score `probs` of the validation split (from `evaluation_probs`) and write every prediction to
    `RUN/val_predictions/step_NNNNNN.jsonl`."""
    # multi-label: checkpoints are compared at 0.5; thresholds are tuned once, on the best one
    thresholds = np.full(len(splits.labels), 0.5) if cfg.multi_label else None
    if run.main:
        path = run.file(f"val_predictions/step_{step:06d}.jsonl")
        write_predictions_jsonl(path, splits.val, probs, splits.labels, thresholds=thresholds)
    return score(splits.val, probs, splits.labels, thresholds)


def score_test_split(
    best: torch.nn.Module,
    val_set: Dataset,
    test_set: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    splits: Splits,
    cfg: TrainConfig,
    run: RunFolder,
    accelerator: Accelerator,
    objective: Objective,
) -> tuple[dict, dict | None]:
    """Score the test split and write every prediction to RUN/test_predictions.jsonl. Validation is scored
    first: multi-label runs tune their thresholds on it (thresholds.json), single-label runs with
    `temperature_scaling` fit their temperature (temperature.json), which the test's probabilities, and every
    later reading of the run, then carry. Returns the test metrics (single-label: with the coverage and
    accuracy at each `--min-confidence` level) and the calibration summary (None without one)."""
    thresholds, calibration = None, None
    if cfg.multi_label or cfg.temperature_scaling:
        why = "thresholds" if cfg.multi_label else "temperature"
        val_probs = evaluation_probs(best, val_set, tokenizer, cfg, accelerator, objective, why)
    if cfg.multi_label:
        thresholds = tune_thresholds(splits.val, val_probs, splits.labels)
        run.write_json("thresholds.json", dict(zip(splits.labels, thresholds.tolist(), strict=True)))
    probs = evaluation_probs(best, test_set, tokenizer, cfg, accelerator, objective, "test")
    if cfg.temperature_scaling and not cfg.multi_label:
        gold = [np.array([splits.label2id[x] for x in t["label"]]) for t in (splits.val, splits.test)]
        temperature, probs, calibration = calibrate(val_probs, gold[0], probs, gold[1])
        run.write_json("temperature.json", {"temperature": temperature})
    if run.main:
        path = run.file("test_predictions.jsonl")
        write_predictions_jsonl(path, splits.test, probs, splits.labels, None, thresholds, cfg.label_type)
    return score_test(splits.test, probs, splits.labels, thresholds), calibration
