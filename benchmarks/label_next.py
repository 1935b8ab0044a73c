"""Does `loracls select` choose texts worth labelling? A simulated labelling loop: the pool is a sample of the
training split with its labels hidden, and a label is revealed when a text is chosen.

    python benchmarks/label_next.py [--data zh-reviews] [--start 50] [--step 50] [--rounds 4]
        [--random-up-to 400] [--pool 2000] [--seeds 1] [--eval 200] [--test 400]
        [--out benchmarks/results/label_next.json] [KEY=VALUE ...]

Each seed starts from `--start` random labels and trains a run on them. Then two ways add `--step` labels a
round: `chosen` asks `loracls select` (the previous round's run, diverse uncertainty sampling) and `random`
draws at random, up to `--random-up-to` labels for the random curve (to see where it reaches what the
chosen labels reach sooner). Every run has the same settings (`SETTINGS`, KEY=VALUE changes them) and the
same validation and test examples (the built-in split at seed 42, as learning_curve.py draws them); rows:
data, way, n, seed, test and validation accuracy / macro-F1, the run's seconds and the selection's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from common import RESULTS, write_result
from learning_curve import COMMON, write_jsonl, write_splits

from loracls.config import TrainConfig, parse_overrides
from loracls.inference.predict import Classifier
from loracls.inference.select import select
from loracls.training.train import train

SETTINGS = {**COMMON, "head_init": "zero", "baseline": False}
"""Every run's settings: learning_curve.py's, with a zero head and no prompt search or baseline (a run on
50-400 labels in about two minutes; the head the prompt starts is a separate question)."""


def run_point(labelled: pd.DataFrame, val: Path, test: Path, seed: int, overrides: dict) -> tuple[dict, Path]:
    """Train on `labelled`; its scores and the run folder (for the next selection)."""
    folder = Path(tempfile.mkdtemp(prefix="select-"))
    write_jsonl(labelled, folder / "train.jsonl")
    files = {"data": str(folder / "train.jsonl"), "val": str(val), "test": str(test)}
    cfg = TrainConfig.load(None, {**files, "seed": seed, "out": str(folder / "run"), **SETTINGS, **overrides})
    started = time.perf_counter()
    _, metrics = train(cfg)
    point = {
        "val": {k: metrics["best_val"][k] for k in ("accuracy", "macro_f1")},
        "test": {k: metrics["test"][k] for k in ("accuracy", "macro_f1")},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return point, folder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="zh-reviews")
    parser.add_argument("--start", type=int, default=50)
    parser.add_argument("--step", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--random-up-to", type=int, default=400)
    parser.add_argument("--pool", type=int, default=2000)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--test", type=int, default=400)
    parser.add_argument("--out", type=Path, default=RESULTS / "label_next.json")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config changes of every run")
    args = parser.parse_args()
    overrides = parse_overrides(args.overrides)
    scratch = Path(tempfile.mkdtemp(prefix="select-splits-"))
    points: list[dict] = []

    def record(point: dict, **where) -> None:
        points.append({"data": args.data, **where, **point})
        print(f"{args.data} {where}: test accuracy {point['test']['accuracy']:.3f} ({point['wall_s']} s)")
        write_result(
            args.out,
            {
                "question": "do the texts loracls select chooses reach an accuracy with fewer labels than "
                "random ones?",
                "settings": SETTINGS,
                "overrides": overrides,
                **{k: getattr(args, k) for k in ("start", "step", "rounds", "random_up_to", "pool")},
                "eval_examples": args.eval,
                "test_examples": args.test,
                "summary": summarise(points),
                "points": points,
            },
        )

    val, test, train_split = write_splits(args.data, args.eval, args.test, scratch)
    for seed in range(args.seeds):
        pool = train_split.sample(min(args.pool, len(train_split)), random_state=seed).reset_index(drop=True)
        rng = np.random.default_rng(seed)
        start = list(rng.choice(len(pool), args.start, replace=False))
        point, folder = run_point(pool.iloc[start], val, test, seed, overrides)
        for way in ("chosen", "random"):
            record(point, way=way, n=args.start, seed=seed)
        chosen = list(start)
        for _ in range(args.rounds):  # chosen: the previous run picks the next labels
            rest = [i for i in range(len(pool)) if i not in set(chosen)]
            started = time.perf_counter()
            classifier = Classifier.from_run(folder / "run")
            picked, _, _ = select(classifier, pool["text"].iloc[rest].tolist(), args.step, seed=seed)
            spent = round(time.perf_counter() - started, 1)
            del classifier
            shutil.rmtree(folder)
            chosen += [rest[i] for i in picked]
            point, folder = run_point(pool.iloc[chosen], val, test, seed, overrides)
            record(point | {"select_s": spent}, way="chosen", n=len(chosen), seed=seed)
        shutil.rmtree(folder)
        drawn = list(start)
        while len(drawn) + args.step <= args.random_up_to:  # random: the same start, labels drawn at random
            rest = [i for i in range(len(pool)) if i not in set(drawn)]
            drawn += list(rng.choice(rest, args.step, replace=False))
            point, folder = run_point(pool.iloc[drawn], val, test, seed, overrides)
            shutil.rmtree(folder)
            record(point, way="random", n=len(drawn), seed=seed)
    rows = summarise(points)
    print(json.dumps(rows, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    shutil.rmtree(scratch)


def summarise(points: list[dict]) -> list[dict]:
    """Mean test and validation accuracy / macro-F1 per way and number of labels, over the seeds."""
    frame = pd.DataFrame(
        [
            {"way": p["way"], "n": p["n"], **{f"{s}_{k}": p[s][k] for s in ("test", "val") for k in p[s]}}
            for p in points
        ]
    )
    grouped = frame.groupby(["way", "n"]).agg(["mean", "min", "max", "count"])
    rows = []
    for (way, n), row in grouped.iterrows():
        rows.append(
            {
                "way": way,
                "n": int(n),
                "seeds": int(row[("test_accuracy", "count")]),
                **{
                    key: round(float(row[(key, "mean")]), 4)
                    for key in frame.columns
                    if key not in ("way", "n")
                },
                "test_accuracy_range": [round(float(row[("test_accuracy", s)]), 4) for s in ("min", "max")],
            }
        )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for way in ("chosen", "random"):
        line = sorted((r["n"], r["test_accuracy"]) for r in rows if r["way"] == way)
        ax.plot([n for n, _ in line], [a for _, a in line], marker="o", label=way)
    ax.set_xlabel("labelled examples")
    ax.set_ylabel("test accuracy")
    ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
