"""`loracls select`: which unlabelled texts to label next, so that the next run learns most from them.

The run's classifier scores the pool; the texts it is least sure of (the smallest margin between its two most
probable labels, calibrated; multi-label: the labels nearest their thresholds) are the candidates. Taking the
`n` least sure alone would pick near-duplicates of one confusing kind, so, as diverse mini-batch active
learning does (Zhdanov 2019), the `CANDIDATES` x `n` least sure are read once more for their features (the
classifier's mean last hidden state), clustered into `n` groups by k-means weighted by uncertainty, and each
group gives the candidate nearest its centre. `benchmarks/label_next.py` measures a simulated labelling loop.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.cluster import KMeans
from sklearn.exceptions import ConvergenceWarning
from sklearn.preprocessing import normalize

from loracls.environment.devices import inference_autocast
from loracls.errors import LoraclsError
from loracls.inference.export_format import folder_kind
from loracls.inference.predict import Classifier
from loracls.training.audit import MeanHiddenState
from loracls.training.evaluate import predict_probs
from loracls.training.runs import RunFolder

CANDIDATES = 10
"""The least sure `CANDIDATES x n` texts are clustered into the `n` chosen (Zhdanov's prefilter, beta)."""


def uncertainty(probs: np.ndarray, thresholds: list[float] | None = None) -> np.ndarray:
    """How unsure the classifier is of each text, in [0, 1]: one minus the margin between its two most
    probable labels (single-label), or one minus twice the smallest distance of a label's probability from its
    threshold (multi-label: the label it is nearest to flipping)."""
    if thresholds is not None:
        return 1 - 2 * np.abs(probs - np.asarray(thresholds)).min(1).clip(max=0.5)
    top = np.sort(probs, 1)
    return 1 - (top[:, -1] - top[:, -2])


def features(classifier: Classifier, texts: list[str], stage: str | None = None) -> np.ndarray:
    """Each text's mean last hidden state in the classifier, read as it reads texts (inside its prompt)."""
    model = classifier.model
    width = model.config.get_text_config().hidden_size
    device = next(model.parameters()).device
    autocast = inference_autocast(device, classifier.precision)
    dataset, pooled = classifier.encode(texts), MeanHiddenState(width)
    batch = classifier.batch_size
    return predict_probs(model, dataset, classifier.tokenizer, batch, device, autocast, None, pooled, stage)


def choose(uncertain: np.ndarray, read: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """Of candidates with uncertainty `uncertain` and features `read` (one row each), the positions of `n`
    chosen: k-means of the length-normalised features into `n` clusters weighted by uncertainty, and in each
    the candidate nearest its centre; the most uncertain first."""
    if n >= len(uncertain):
        return np.argsort(-uncertain, kind="stable")
    points = normalize(read)
    weights = uncertain + 1e-6  # a candidate the model is sure of still counts a little
    with warnings.catch_warnings():  # fewer distinct points than n: handled below
        warnings.simplefilter("ignore", ConvergenceWarning)
        clusters = KMeans(n, n_init=3, random_state=seed).fit(points, sample_weight=weights)
    distance = ((points - clusters.cluster_centers_[clusters.labels_]) ** 2).sum(1)
    chosen = [
        np.flatnonzero(clusters.labels_ == k)[np.argmin(distance[clusters.labels_ == k])]
        for k in np.unique(clusters.labels_)
    ]
    # fewer clusters than n hold a candidate when candidates coincide: the least sure of the rest fill in
    rest = [i for i in np.argsort(-uncertain, kind="stable") if i not in set(chosen)]
    chosen = np.array(chosen + rest[: n - len(chosen)])
    return chosen[np.argsort(-uncertain[chosen], kind="stable")]


def select(
    classifier: Classifier,
    texts: list[str],
    n: int,
    diverse: bool = True,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The positions in `texts` of the `n` to label next, most uncertain first, with every text's class
    probabilities and uncertainty. `diverse=False`: the `n` least sure, without clustering."""
    if n < 1:
        raise LoraclsError(f"--n must be at least 1, not {n}")
    probs = classifier.predict_probs(texts, "scoring the pool")
    unsure = uncertainty(probs, classifier.thresholds)
    ranked = np.argsort(-unsure, kind="stable")
    if not diverse or n >= len(texts):
        return ranked[:n], probs, unsure
    candidates = ranked[: CANDIDATES * n]
    read = features(classifier, [texts[i] for i in candidates], "reading the candidates")
    return candidates[choose(unsure[candidates], read, n, seed)], probs, unsure


def known_texts(path: str | Path) -> set[str]:
    """The texts a run folder already holds in its splits (trained, validated, tested); none for an export."""
    if folder_kind(Path(path)) != "run":
        return set()
    run = RunFolder(path)
    return {str(t) for name in ("train", "val", "test") for t in run.read_split(name)["text"]}


def label_column(path: str | Path) -> str:
    """The label column of the run's training data (an export: `label`)."""
    if folder_kind(Path(path)) != "run":
        return "label"
    return RunFolder(path).read_config().label_column


def pool_table(frame: pd.DataFrame, column: str, known: set[str]) -> tuple[pd.DataFrame, list[str]]:
    """The pool's rows to choose from: empty texts, repeats and texts the run already holds (`known`: its
    splits' texts) left out, with notes of what was."""
    notes = []
    texts = frame[column].fillna("").astype(str)
    keep = texts.str.strip().ne("")
    if (~keep).sum():
        notes.append(f"{(~keep).sum()} empty texts left out")
    seen = texts.isin(known) & keep
    if seen.sum():
        notes.append(f"{seen.sum()} texts the run already trained, validated or tested on left out")
    repeated = texts.duplicated() & keep & ~seen
    if repeated.sum():
        notes.append(f"{repeated.sum()} repeated texts left out (the first copy kept)")
    kept = frame[keep & ~seen & ~repeated]
    if kept.empty:
        raise LoraclsError("the pool has no text left to choose from")
    return kept, notes


def selection_table(
    pool: pd.DataFrame,
    chosen: np.ndarray,
    probs: np.ndarray,
    unsure: np.ndarray,
    labels: list[str],
    label_column: str,
) -> pd.DataFrame:
    """The chosen rows in the training file's layout: the pool's columns, the label column empty to fill
    in, and what the classifier now thinks (`predicted`, `p_predicted`, `uncertainty`) to help whoever
    labels them (training reads only the text and label columns)."""
    table = pool.iloc[chosen].reset_index(drop=True).copy()
    table[label_column] = ""
    table["predicted"] = [labels[i] for i in probs[chosen].argmax(1)]
    table["p_predicted"] = probs[chosen].max(1).astype(float).round(4)
    table["uncertainty"] = unsure[chosen].astype(float).round(4)
    return table
