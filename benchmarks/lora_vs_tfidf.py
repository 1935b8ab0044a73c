"""Does LoRA with default settings beat a TF-IDF + logistic-regression classifier on the same small split?

Baseline: TF-IDF character 1-3-grams + logistic regression, trained on exactly the training examples loracls
uses (and, for reference, on the whole training split). Candidate: `loracls train` on Gemma 3 270M with the
default settings. Both are scored on the same test examples.

    python benchmarks/lora_vs_tfidf.py [--train 2000] [--eval 800] [--data zh-reviews]

Prints a table and writes benchmarks/results/lora_vs_tfidf.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, f1_score

from loracls.config import TrainConfig, parse_overrides
from loracls.data.splits import load_splits
from loracls.training.runs import environment
from loracls.training.train import train

RESULTS = Path(__file__).parent / "results"


def tfidf_scores(train_texts, train_labels, test_texts, test_labels) -> dict:
    start = time.perf_counter()
    vectorizer = TfidfVectorizer(analyzer="char_wb", ngram_range=(1, 3), sublinear_tf=True, min_df=2)
    classifier = LogisticRegression(max_iter=2000, C=4.0)
    classifier.fit(vectorizer.fit_transform(train_texts), train_labels)
    predicted = classifier.predict(vectorizer.transform(test_texts))
    return {
        "accuracy": accuracy_score(test_labels, predicted),
        "macro_f1": f1_score(test_labels, predicted, average="macro"),
        "train_examples": len(train_texts),
        "wall_s": time.perf_counter() - start,
    }


def run_loracls(cfg: TrainConfig, overrides: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        variant = TrainConfig.load(None, cfg.to_dict() | overrides | {"out": str(Path(tmp) / "run")})
        start = time.perf_counter()
        _, metrics = train(variant)
        wall = time.perf_counter() - start
    return {
        "overrides": overrides,
        "accuracy": metrics["test"]["accuracy"],
        "macro_f1": metrics["test"]["macro_f1"],
        "train_examples": metrics["data"]["train"],
        "best_val_step": metrics["best_val"]["step"],
        "best_val_accuracy": metrics["best_val"]["accuracy"],
        "train_examples_per_s": metrics["train"]["examples_per_s"],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="zh-reviews")
    parser.add_argument("--train", type=int, default=2000, help="training examples for both classifiers")
    parser.add_argument("--eval", type=int, default=800, help="validation and test examples each")
    parser.add_argument("--out", type=Path, default=RESULTS / "lora_vs_tfidf.json")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="also train a variant of the defaults with these overrides (repeatable)",
    )
    args = parser.parse_args()
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)  # the code that runs

    cfg = TrainConfig(data=args.data, max_train_examples=args.train, max_eval_examples=args.eval)
    full = load_splits(TrainConfig(data=args.data, max_eval_examples=args.eval))
    splits = load_splits(cfg)
    assert list(splits.test["id"]) == list(full.test["id"]), "both baselines must see the same test split"
    test = (list(splits.test["text"]), list(splits.test["label"]))
    baseline = tfidf_scores(list(splits.train["text"]), list(splits.train["label"]), *test)
    baseline_full = tfidf_scores(list(full.train["text"]), list(full.train["label"]), *test)

    candidates = {"loracls defaults": {}} | {f"loracls {o}": parse_overrides([o]) for o in args.also}
    results = {name: run_loracls(cfg, overrides) for name, overrides in candidates.items()}

    rows = [
        ("tfidf+lr, same split (baseline)", baseline),
        ("tfidf+lr, full train split", baseline_full),
        *results.items(),
    ]
    print(f"\n{'classifier':34} {'train':>6} {'accuracy':>9} {'macro-F1':>9} {'wall s':>8}")
    for name, r in rows:
        n, acc, f1, wall = r["train_examples"], r["accuracy"], r["macro_f1"], r["wall_s"]
        print(f"{name:34} {n:>6} {acc:>9.4f} {f1:>9.4f} {wall:>8.1f}")
    print()
    for name, r in results.items():
        gain, errors = r["accuracy"] - baseline["accuracy"], (1 - r["accuracy"]) / (1 - baseline["accuracy"])
        print(f"{name} - baseline: {gain:+.4f} accuracy; error rate {errors:.2f}x the baseline's")

    result = {
        "question": "LoRA defaults vs TF-IDF + LR on the same training examples",
        "command": "python benchmarks/lora_vs_tfidf.py " + " ".join(sys.argv[1:]),
        "data": args.data,
        "test_examples": len(test[0]),
        "seed": cfg.seed,
        "config": cfg.to_dict() | {"out": None},
        "baseline": baseline,
        "baseline_full_train": baseline_full,
        "loracls": results,
        "accuracy_gain": {name: r["accuracy"] - baseline["accuracy"] for name, r in results.items()},
        "git": git.stdout.strip() or None,
        "machine": {"processor": platform.processor(), "cpus": os.cpu_count()},
        "env": environment(torch.device("cpu")),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
