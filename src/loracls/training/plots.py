"""The run report's figures (matplotlib, drawn to PNG bytes without a window): training curves, the confusion
matrix, per-class scores, the reliability diagram and the coverage of abstaining."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def png(figure: plt.Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def curves_figure(log: list[dict], best_step: int | None, peak_lr: float) -> plt.Figure | None:
    """Training loss, learning rate and validation accuracy/macro-F1 over optimizer steps; None for a run
    too short to draw curves (under two training logs and under two validations: `short_run_section`).

    Points are marked (a short run is a few of them), the steps run from 0 in whole numbers, the loss from 0
    and the learning rate from 0 to its peak: one point at lr 0 sat on a +-4e-2 axis."""
    train = [r for r in log if r["kind"] == "train"]
    evals = [r for r in log if r["kind"] == "eval"]
    if len(train) < 2 and len(evals) < 2:
        return None
    marked = {"marker": "o", "markersize": 3} if len(train) <= 60 else {}
    steps = [r["step"] for r in train]
    losses, lrs = [r["loss"] for r in train], [r["lr"] for r in train]
    top = 1.08 * max([peak_lr, *lrs]) or 1.0
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    axes[0].plot(steps, losses, **marked)
    axes[0].set(title="training loss", xlabel="optimizer step")
    if losses and np.isfinite(max(losses)):
        axes[0].set_ylim(0, 1.08 * max(losses) or 1.0)
    axes[1].plot(steps, lrs, color="tab:orange", **marked)
    axes[1].set(title="learning rate", xlabel="optimizer step", ylim=(-0.03 * top, top))
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    for key, name in (("val_accuracy", "accuracy"), ("val_macro_f1", "macro-F1")):
        axes[2].plot([r["step"] for r in evals], [r[key] for r in evals], marker="o", label=name)
    if best_step:
        axes[2].axvline(best_step, color="grey", linestyle=":", label=f"best (step {best_step})")
    axes[2].set(title="validation", xlabel="optimizer step")
    axes[2].legend(fontsize=8)
    last = max(r["step"] for r in log)
    for ax in axes:
        ax.set_xlim(0, last * 1.03 + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def confusion_plot(matrix: list[list[int]], labels: list[str]) -> bytes:
    """Counts, coloured by the share of each gold class (rows sum to 1)."""
    counts = np.asarray(matrix)
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    size = 1.2 + 0.7 * len(labels)
    figure, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    for (i, j), n in np.ndenumerate(counts):
        ax.text(j, i, str(n), ha="center", va="center", color="white" if shares[i, j] > 0.5 else "black")
    ax.set(
        xticks=range(len(labels)),
        yticks=range(len(labels)),
        xlabel="predicted",
        ylabel="gold",
        title="test confusion matrix",
    )
    ax.set_xticklabels(labels, rotation=45, ha="right")
    ax.set_yticklabels(labels)
    figure.colorbar(image, ax=ax, fraction=0.046, label="share of gold class")
    return png(figure)


def per_class_plot(per_class: dict) -> bytes:
    labels = list(per_class)
    x = np.arange(len(labels))
    figure, ax = plt.subplots(figsize=(2 + 1.1 * len(labels), 3.2))
    for k, key in enumerate(("precision", "recall", "f1-score")):
        ax.bar(x + (k - 1) * 0.27, [per_class[name][key] for name in labels], width=0.27, label=key)
    ax.set(xticks=x, ylim=(0, 1), title="test precision / recall / F1 per class")
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return png(figure)


def reliability_plot(calibration: dict) -> bytes:
    """Accuracy against confidence per confidence bin of the test split, before and after the temperature;
    a calibrated classifier's points lie on the diagonal, each point's area its examples."""
    figure, ax = plt.subplots(figsize=(4.6, 4.2))
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="calibrated")
    for key, name in (("before", "raw"), ("after", f"temperature {calibration['temperature']:.2f}")):
        bins, ece = calibration[f"bins_{key}"], calibration[f"ece_{key}"]
        confidence, accuracy = [b["confidence"] for b in bins], [b["accuracy"] for b in bins]
        line = ax.plot(confidence, accuracy, label=f"{name} (ECE {ece:.3f})")[0]
        total = max(sum(b["n"] for b in bins), 1)
        ax.scatter(confidence, accuracy, s=[12 + 200 * b["n"] / total for b in bins], color=line.get_color())
    ax.set(xlim=(0, 1.02), ylim=(0, 1.02), xlabel="confidence", ylabel="accuracy", title="reliability (test)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return png(figure)


def coverage_plot(coverage: list[dict]) -> bytes:
    """Accuracy on the texts that keep a label against the share that does, one point per
    `--min-confidence` level (labelled with it)."""
    rows = [r for r in coverage if r["accuracy"] is not None]
    figure, ax = plt.subplots(figsize=(4.6, 4.2))
    ax.plot([r["coverage"] for r in rows], [r["accuracy"] for r in rows], marker="o")
    for r in rows:
        ax.annotate(
            f"{r['min_confidence']:g}",
            (r["coverage"], r["accuracy"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, 4),
        )
    ax.set(
        xlim=(0, 1.02),
        xlabel="coverage (share of texts labelled)",
        ylabel="accuracy on them",
        title="abstaining below a confidence (test)",
    )
    ax.grid(alpha=0.3)
    return png(figure)
