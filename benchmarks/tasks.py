"""Does loracls beat the simple baseline on every kind of task, not only sentiment? Per task and training
size: the zero-shot prompt, TF-IDF + logistic regression and `loracls train` with its defaults, on the same
examples.

    python benchmarks/tasks.py [--tasks zh-reviews,en-tweets,banking77] [--sizes banking77=10/class,all ...]
        [--seeds 3] [--seeded-up-to 2400] [--eval 400] [--test 800] [--methods tfidf,loracls]
        [--out benchmarks/results/tasks.json] [--resume] [KEY=VALUE ...]

Tasks: the built-in `zh-reviews` (2 classes) and `en-tweets` (3), and BANKING77 (77 intents of online-banking
queries, labels that are codes such as `card_arrival`; `benchmarks/data/banking77/`, CC BY 4.0, Casanueva et
al. 2020). A size is a number of training examples, or `N/class` (BANKING77's learning curve: 10/class,
30/class, `all`). Every point of a task is validated and tested on the same examples (the built-in split at
seed 42; BANKING77: 5 per intent of its training file held out for validation, its test file sampled to
`--test`); only the training sample changes with the seed (sizes above `--seeded-up-to` examples use seed 0).

Methods (each a row of `results/tasks.json`'s `rows`: task, train_examples, seed, method, accuracy, macro_f1,
seconds, and the validation figures the choice of defaults may look at):
  zero-shot  loracls' prompt baseline on the test examples (the base model's LM head, no training), as the
             defaults run scores it; seconds: its own scoring time
  tfidf      TF-IDF of word 1-2-grams and character 2-5-grams + logistic regression, the features and C
             chosen by cross-validation on the training sample (scikit-learn's GridSearchCV)
  loracls    `loracls train` with the defaults (KEY=VALUE pairs change them); seconds: the whole run, prompt
             choice and baseline included; also its steps and whether validation was still improving

Defaults are to be chosen on the `val_*` figures, never on test. Results are written after every point, each
with the commit and CPU flags (`common.write_result`); `--resume` keeps the points `--out` already holds.
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
from common import CODE, RESULTS, machine, write_result
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, f1_score
from sklearn.model_selection import GridSearchCV, StratifiedKFold
from sklearn.pipeline import Pipeline

from loracls.config import TrainConfig, parse_overrides
from loracls.data.splits import load_splits, stratified_sample
from loracls.environment.devices import mixed_precision
from loracls.training.train import train

BANKING77 = Path(__file__).parent / "data" / "banking77"
SIZES = {"zh-reviews": ["2000"], "en-tweets": ["2000"], "banking77": ["10/class", "30/class", "all"]}
"""Each task's training sizes when `--sizes` does not name it."""


def banking77_splits(eval_n: int, test_n: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """BANKING77's training pool, validation (5 per intent of its training file, seed 42) and test (its
    test file, a stratified `test_n` of it at seed 42; all of it when `test_n` covers it)."""
    train = pd.read_csv(BANKING77 / "train.csv").rename(columns={"category": "label"})
    test = pd.read_csv(BANKING77 / "test.csv").rename(columns={"category": "label"})
    val = train.sample(frac=1.0, random_state=42).groupby("label", sort=False).head(max(1, eval_n // 77))
    pool = train.drop(val.index)
    if test_n < len(test):
        test = stratified_sample(test, test_n, 42)
    return pool.reset_index(drop=True), val.reset_index(drop=True), test.reset_index(drop=True)


def builtin_splits(task: str, eval_n: int, test_n: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """A built-in set's training split, and samples of its validation and test splits (seed 42)."""
    splits = load_splits(TrainConfig(data=task, seed=42))
    val, test = (stratified_sample(t, n, 42) for t, n in ((splits.val, eval_n), (splits.test, test_n)))
    return splits.train, val, test


def training_sample(pool: pd.DataFrame, size: str, seed: int) -> pd.DataFrame:
    """`size` examples of the pool (stratified), `N/class` of each label, or `all`."""
    if size == "all":
        return pool
    if size.endswith("/class"):
        per_class = int(size.removesuffix("/class"))
        shuffled = pool.sample(frac=1.0, random_state=seed)
        return shuffled.groupby("label", sort=False).head(per_class).reset_index(drop=True)
    return stratified_sample(pool, int(size), seed)


def write_jsonl(table: pd.DataFrame, path: Path) -> Path:
    """JSON lines, not CSV: tweets hold bare carriage returns, which a CSV round trip splits into rows."""
    table[["text", "label"]].to_json(path, orient="records", lines=True, force_ascii=False)
    return path


def tfidf(train: pd.DataFrame, val: pd.DataFrame, test: pd.DataFrame) -> dict:
    """TF-IDF + logistic regression, its features and C chosen by cross-validation on the training sample."""
    started = time.perf_counter()
    pipeline = Pipeline(
        [("tfidf", TfidfVectorizer(sublinear_tf=True)), ("lr", LogisticRegression(max_iter=3000))]
    )
    grid = {
        "tfidf__analyzer": ["word", "char_wb"],
        "lr__C": [1.0, 10.0, 100.0],
    }
    folds = int(min(3, train["label"].value_counts().min()))
    search = GridSearchCV(
        pipeline,
        [
            {**grid, "tfidf__analyzer": ["word"], "tfidf__ngram_range": [(1, 2)]},
            {**grid, "tfidf__analyzer": ["char_wb"], "tfidf__ngram_range": [(2, 5)]},
        ],
        cv=StratifiedKFold(folds, shuffle=True, random_state=0),
        scoring="f1_macro",
        n_jobs=1,
    )
    search.fit(list(train["text"]), list(train["label"]))
    scores = {}
    for split, table in (("val", val), ("test", test)):
        predicted = search.predict(list(table["text"]))
        scores[split] = {
            "accuracy": accuracy_score(table["label"], predicted),
            "macro_f1": f1_score(table["label"], predicted, average="macro"),
        }
    return {
        "accuracy": scores["test"]["accuracy"],
        "macro_f1": scores["test"]["macro_f1"],
        "val_accuracy": scores["val"]["accuracy"],
        "val_macro_f1": scores["val"]["macro_f1"],
        "seconds": time.perf_counter() - started,
        "chosen": {k.split("__")[1]: v for k, v in search.best_params_.items()},
        "cv_folds": folds,
    }


def run_loracls(files: dict, seed: int, overrides: dict) -> tuple[dict, dict | None]:
    """The defaults run's row, and the zero-shot row from the prompt baseline it scored (None without)."""
    run_dir = Path(tempfile.mkdtemp(prefix="tasks-"))
    cfg = TrainConfig.load(None, {**files, "seed": seed, **overrides, "out": str(run_dir / "run")})
    started = time.perf_counter()
    run, metrics = train(cfg)
    seconds = time.perf_counter() - started
    pinned = run.read_config()
    learning = metrics["learning"]
    row = {
        "accuracy": metrics["test"]["accuracy"],
        "macro_f1": metrics["test"]["macro_f1"],
        "val_accuracy": metrics["best_val"]["accuracy"],
        "val_macro_f1": metrics["best_val"]["macro_f1"],
        "seconds": seconds,
        "steps": learning["steps"],
        "best_step": learning.get("best_step"),
        "still_improving": learning.get("still_improving"),
        "head_init": pinned.head_init,
        "prompt": pinned.prompt if pinned.prompted else None,
    }
    zero_shot = None
    if metrics.get("baseline"):
        baseline = metrics["baseline"]
        zero_shot = {
            "accuracy": baseline["accuracy"],
            "macro_f1": baseline["macro_f1"],
            "seconds": baseline.get("wall_s"),
            "calibrated": {
                k: baseline[k] for k in ("calibrated_accuracy", "calibrated_macro_f1") if k in baseline
            },
        }
    shutil.rmtree(run_dir)
    return row, zero_shot


def summary(rows: list[dict]) -> list[dict]:
    """Mean and min-max of test macro-F1 and accuracy per task, size and method (over the seeds)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["size"], r["method"]), []).append(r)
    out = []
    for (task, size, method), found in groups.items():
        f1 = [r["macro_f1"] for r in found]
        acc = [r["accuracy"] for r in found]
        seconds = [r["seconds"] for r in found if r.get("seconds") is not None]
        out.append(
            {
                "task": task,
                "size": size,
                "train_examples": found[0]["train_examples"],
                "method": method,
                "seeds": len(found),
                "accuracy": round(float(np.mean(acc)), 4),
                "macro_f1": round(float(np.mean(f1)), 4),
                "macro_f1_range": [round(min(f1), 4), round(max(f1), 4)],
                "seconds": round(float(np.mean(seconds)), 1) if seconds else None,
            }
        )
    return out


def table(summarised: list[dict]) -> str:
    lines = [
        "| task | train | seeds | zero-shot | TF-IDF + LR | loracls defaults | loracls - TF-IDF (macro-F1) |",
        "|---|---|---|---|---|---|---|",
    ]
    cells = {(s["task"], s["size"], s["method"]): s for s in summarised}
    for task, size in dict.fromkeys((s["task"], s["size"]) for s in summarised):
        found = [cells.get((task, size, m)) for m in ("zero-shot", "tfidf", "loracls")]
        shown = [
            f"{s['accuracy']:.3f} / {s['macro_f1']:.3f}"
            + (f" ({s['seconds']:.0f} s)" if s["seconds"] else "")
            if s
            else "-"
            for s in found
        ]
        gain = f"{found[2]['macro_f1'] - found[1]['macro_f1']:+.3f}" if found[1] and found[2] else "-"
        n = next(s for s in found if s)
        lines.append(
            f"| {task} | {n['train_examples']} ({size}) | {n['seeds']} | "
            + " | ".join(shown)
            + f" | {gain} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="zh-reviews,en-tweets,banking77")
    parser.add_argument(
        "--sizes", action="append", default=[], metavar="TASK=SIZE,...", help="a task's sizes (repeatable)"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seeded-up-to", type=int, default=2400, help="larger samples use seed 0 only")
    parser.add_argument("--eval", type=int, default=400, help="validation examples (BANKING77: 5 per intent)")
    parser.add_argument("--test", type=int, default=800, help="test examples")
    parser.add_argument("--methods", default="tfidf,loracls", help="loracls also gives the zero-shot row")
    parser.add_argument("--out", type=Path, default=RESULTS / "tasks.json")
    parser.add_argument("--resume", action="store_true", help="keep the points --out already holds")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="changes to loracls' defaults")
    args = parser.parse_args()
    sizes = SIZES | {k: v.split(",") for k, v in (s.split("=", 1) for s in args.sizes)}
    overrides = parse_overrides(args.overrides)
    methods = args.methods.split(",")
    rows = json.loads(args.out.read_text())["rows"] if args.resume and args.out.is_file() else []
    done = {(r["task"], r["size"], r["seed"], r["method"]) for r in rows}
    where = {"cpu_flags": machine()["cpu_flags"], "precision": mixed_precision("auto")}
    folder = Path(tempfile.mkdtemp(prefix="tasks-"))
    for task in args.tasks.split(","):
        if task == "banking77":
            pool, val, test = banking77_splits(args.eval, args.test)
        else:
            pool, val, test = builtin_splits(task, args.eval, args.test)
        files = {
            "val": str(write_jsonl(val, folder / f"{task}-val.jsonl")),
            "test": str(write_jsonl(test, folder / f"{task}-test.jsonl")),
        }
        for size in sizes[task]:
            sample0 = training_sample(pool, size, 0)
            for seed in range(args.seeds if len(sample0) <= args.seeded_up_to else 1):
                sample = training_sample(pool, size, seed)
                point = {"task": task, "size": size, "train_examples": len(sample), "seed": seed}
                data = str(write_jsonl(sample, folder / f"{task}-{size.replace('/', '-')}-{seed}.jsonl"))
                found = {}
                if "tfidf" in methods and (task, size, seed, "tfidf") not in done:
                    print(f"== {task} {size} seed {seed}: tfidf", flush=True)
                    found["tfidf"] = tfidf(sample, val, test)
                if "loracls" in methods and (task, size, seed, "loracls") not in done:
                    print(f"== {task} {size} seed {seed}: loracls", flush=True)
                    found["loracls"], zero_shot = run_loracls({**files, "data": data}, seed, overrides)
                    if zero_shot:
                        found["zero-shot"] = zero_shot
                for method, figures in found.items():
                    rows.append({**point, "method": method, **figures, "git": CODE[0], **where})
                    done.add((task, size, seed, method))
                summarised = summary(rows)
                write_result(
                    args.out,
                    {
                        "question": "zero-shot, TF-IDF + LR and loracls defaults on every kind of task",
                        "overrides": overrides,
                        "eval_examples": args.eval,
                        "test_examples": args.test,
                        "summary": summarised,
                        "rows": rows,
                    },
                )
    print(table(summary(rows)))
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
