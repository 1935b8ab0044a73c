"""Probabilities a user can threshold: one temperature fitted on the validation split after training
(Guo et al. 2017, "On Calibration of Modern Neural Networks"), applied wherever the classifier answers, and
the expected calibration error (ECE) before and after.

A temperature divides the logits before the softmax. It leaves every argmax, and so accuracy and macro-F1,
as they were, and changes only how sure the probabilities say the classifier is. Given probabilities
`p = softmax(z)`, `softmax(log p / T) = softmax(z / T)`, so it applies to saved probabilities as well.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax, softmax

BINS = 15
"""Equal-width confidence bins of the ECE (the usual 15 of Guo et al.)."""


def with_temperature(probs: np.ndarray, temperature: float) -> np.ndarray:
    """`probs` (examples x classes, each row a softmax) as the softmax of their logits divided by
    `temperature`."""
    if temperature == 1.0:
        return probs
    return softmax(np.log(np.clip(probs, 1e-30, 1.0)) / temperature, axis=-1).astype(np.float32)


def fit_temperature(probs: np.ndarray, gold: np.ndarray) -> float:
    """The temperature that minimises the negative log-likelihood of the `gold` class ids (a bounded search
    over log T in [-3, 3]: T between 0.05 and 20)."""
    logs = np.log(np.clip(probs.astype(np.float64), 1e-30, 1.0))
    rows = np.arange(len(gold))

    def nll(log_t: float) -> float:
        return float(-log_softmax(logs / np.exp(log_t), axis=-1)[rows, gold].mean())

    return float(np.exp(minimize_scalar(nll, bounds=(-3.0, 3.0), method="bounded").x))


def reliability(probs: np.ndarray, gold: np.ndarray, bins: int = BINS) -> dict:
    """The expected calibration error (the mean gap between confidence and accuracy over equal-width
    confidence bins, weighted by their examples) and each non-empty bin's confidence, accuracy and count."""
    confidence, right = probs.max(-1), probs.argmax(-1) == gold
    which = np.minimum((confidence * bins).astype(int), bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            conf, acc = float(confidence[inside].mean()), float(right[inside].mean())
            ece += inside.mean() * abs(conf - acc)
            table.append({"confidence": conf, "accuracy": acc, "n": int(inside.sum())})
    return {"ece": float(ece), "bins": table}


def calibrate(val_probs: np.ndarray, val_gold: np.ndarray, test_probs: np.ndarray, test_gold: np.ndarray):
    """The temperature fitted on validation, the test probabilities with it, and what `metrics.json`
    records of it: the temperature, and the test ECE (with its reliability bins) before and after."""
    temperature = fit_temperature(val_probs, val_gold)
    calibrated = with_temperature(test_probs, temperature)
    before, after = reliability(test_probs, test_gold), reliability(calibrated, test_gold)
    summary = {
        "temperature": temperature,
        "ece_before": before["ece"],
        "ece_after": after["ece"],
        "bins_before": before["bins"],
        "bins_after": after["bins"],
    }
    return temperature, calibrated, summary


CONFIDENCE_LEVELS = (0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
"""The `--min-confidence` levels whose coverage and accuracy `metrics.json` and the report show."""


def abstains(probs: np.ndarray, min_confidence: float | None) -> np.ndarray:
    """Which rows get no label under `--min-confidence`: their top probability is below it (none for None)."""
    if min_confidence is None:
        return np.zeros(len(probs), dtype=bool)
    return np.asarray(probs).max(-1) < min_confidence


def coverage(probs: np.ndarray, gold: np.ndarray, levels: tuple = CONFIDENCE_LEVELS) -> list[dict]:
    """Selective classification: at each `--min-confidence` level, the share of texts that still get a label
    (coverage) and the accuracy on those (None where no text does)."""
    right = probs.argmax(-1) == gold
    rows = []
    for level in levels:
        answered = ~abstains(probs, level)
        accuracy = float(right[answered].mean()) if answered.any() else None
        rows.append({"min_confidence": level, "coverage": float(answered.mean()), "accuracy": accuracy})
    return rows
