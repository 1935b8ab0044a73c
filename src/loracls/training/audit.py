"""`loracls data audit`: the labelled examples whose label is probably wrong, before training on them.

Confident learning (Northcutt et al. 2021, through `cleanlab`) needs, for every example, class probabilities
from a model that did not see that example's label. Training k LoRA runs to get them would cost k runs; this
reads every text once with the frozen base model instead (its last hidden states, averaged over the text's
tokens) and cross-validates a logistic regression on those features: k folds, each example's probabilities
from the fold that held it out. `cleanlab.filter.find_label_issues` then flags the examples whose given label
those probabilities contradict, ranked by the probability of the given label (`self_confidence`, lowest
first). `benchmarks/audit.py` measures how well this finds labels flipped on purpose.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from cleanlab.filter import find_label_issues
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV, StratifiedKFold, cross_val_predict
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from loracls.config import TrainConfig
from loracls.data.labels import is_multi_label, label_ids, label_names, separator, sort_labels
from loracls.data.splits import deduplicate, stratified_sample
from loracls.data.tables import read_labelled
from loracls.data.tokenization import tokenize
from loracls.environment.devices import inference_autocast, inference_device
from loracls.environment.micro_batch import eval_batch_size
from loracls.errors import LoraclsError
from loracls.model import load_classifier, load_tokenizer, resolve_model
from loracls.training.evaluate import predict_probs

REGULARISATION = (0.01, 0.1, 1.0)
"""The logistic regression's inverse regularisation strengths C tried (3-fold log-loss on the data)."""


@dataclass
class MeanHiddenState:
    """The features `predict_probs` reads here in place of class probabilities: each text's last hidden
    states averaged over its tokens (padding excluded), float32."""

    width: int

    def probs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        states = model(**batch, output_hidden_states=True).hidden_states[-1].float()
        mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
        return (states * mask).sum(1) / mask.sum(1).clamp(min=1)

    def classes(self, model: torch.nn.Module) -> int:
        return self.width


def audit_table(cfg: TrainConfig, max_examples: int | None = None) -> tuple[pd.DataFrame, list[str]]:
    """The rows `cfg.data` holds as training would read them (repeated texts handled by `dedup`), at most
    `max_examples` of them (a stratified sample at `cfg.seed`), with notes of what was dropped."""
    if cfg.multi_label:
        raise LoraclsError("data audit reads single-label data; a multi-label file is not audited yet")
    notes: list[str] = []
    table = read_labelled(cfg.data, cfg.text_column, cfg.label_column, separator(cfg), None, notes)
    if is_multi_label(table["label"]):
        raise LoraclsError(f"{cfg.data}: labels are lists (several per text); data audit reads one per text")
    table = deduplicate(table, cfg.data, cfg.dedup, notes)
    if max_examples and len(table) > max_examples:
        table = stratified_sample(table, max_examples, cfg.seed).reset_index(drop=True)
        notes.append(f"audited a sample of {len(table)} rows (--max-examples)")
    return table.reset_index(drop=True), notes


def text_features(table: pd.DataFrame, cfg: TrainConfig, precision: str = "auto") -> np.ndarray:
    """Each text's mean last hidden state from the frozen base `cfg.model` (texts cut to `cfg.max_length`
    tokens), examples x hidden size."""
    path = resolve_model(cfg.model)
    tokenizer = load_tokenizer(path, cfg.trust_remote_code)
    labels = sort_labels(label_names(table["label"]))
    model = load_classifier(path, labels, cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
    model.config.pad_token_id = tokenizer.pad_token_id  # its head pools at the last token before padding
    device = inference_device()
    model.to(device)
    dataset = tokenize(table, tokenizer, cfg.max_length, label_ids(labels), stage="tokenising")
    width = model.config.get_text_config().hidden_size
    batch = eval_batch_size(cfg.micro_batch_size)
    autocast = inference_autocast(device, precision)
    pooled = MeanHiddenState(width)
    return predict_probs(model, dataset, tokenizer, batch, device, autocast, None, pooled, "reading texts")


def out_of_sample_probs(features: np.ndarray, gold: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Class probabilities of every example from a logistic regression that did not see it: `folds`-fold
    cross-validation (fewer when the rarest class has fewer examples), C chosen by 3-fold log-loss."""
    rarest = int(np.bincount(gold).min())
    if rarest < 2:
        raise LoraclsError("a class with a single example cannot be cross-validated; add examples or drop it")
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    search = GridSearchCV(
        model,
        {"logisticregression__C": REGULARISATION},
        cv=StratifiedKFold(min(3, rarest), shuffle=True, random_state=seed),
        scoring="neg_log_loss",
    )
    best = search.fit(features, gold).best_estimator_
    split = StratifiedKFold(min(folds, rarest), shuffle=True, random_state=seed)
    return cross_val_predict(best, features, gold, cv=split, method="predict_proba")


def label_issues(table: pd.DataFrame, probs: np.ndarray, labels: list[str]) -> pd.DataFrame:
    """The rows cleanlab flags, most suspicious first: `id`, `text`, the given `label`, the `suggested` one
    (the most probable), `p_label` and `p_suggested` (their out-of-sample probabilities)."""
    gold = np.array([label_ids(labels)[x] for x in table["label"]])
    flagged = find_label_issues(gold, probs, return_indices_ranked_by="self_confidence")
    suggested = probs.argmax(1)
    return pd.DataFrame(
        {
            "id": table["id"].to_numpy()[flagged],
            "text": table["text"].to_numpy()[flagged],
            "label": table["label"].to_numpy()[flagged],
            "suggested": [labels[i] for i in suggested[flagged]],
            "p_label": probs[flagged, gold[flagged]].round(4),
            "p_suggested": probs[flagged, suggested[flagged]].round(4),
        }
    )


def audit(
    cfg: TrainConfig, folds: int = 5, max_examples: int | None = None, precision: str = "auto"
) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Audit `cfg.data`: the table audited, its label issues (`label_issues`) and a summary (rows, flagged,
    folds, seconds, notes)."""
    started = time.perf_counter()
    table, notes = audit_table(cfg, max_examples)
    labels = sort_labels(label_names(table["label"]))
    if len(labels) < 2:
        raise LoraclsError(f"{cfg.data}: one class only ({labels}); nothing to audit")
    features = text_features(table, cfg, precision)
    gold = np.array([label_ids(labels)[x] for x in table["label"]])
    probs = out_of_sample_probs(features, gold, folds, cfg.seed)
    issues = label_issues(table, probs, labels)
    accuracy = float((probs.argmax(1) == gold).mean())
    summary = {
        "data": cfg.data,
        "model": cfg.model,
        "rows": len(table),
        "flagged": len(issues),
        "folds": min(folds, int(np.bincount(gold).min())),
        "cross_validated_accuracy": accuracy,
        "seconds": time.perf_counter() - started,
        "notes": notes,
    }
    return table, issues, summary
