"""Which way learns most from few labelled examples? A learning curve on the built-in data sets: test
accuracy and macro-F1 of each way at each training size, with the seeds' spread.

    python benchmarks/learning_curve.py [--data zh-reviews,en-tweets] [--sizes 50,100,200,400,800,2000]
        [--seeds 3] [--seeded-up-to 400] [--ways tfidf,today,zero,verbalizer] [--eval 200] [--test 400]
        [--out benchmarks/results/learning_curve.json] [--resume] [--include OTHER.json] [KEY=VALUE ...]

Every point of a data set trains on a stratified sample of its training split (seed s; sizes above
`--seeded-up-to` use seed 0 only) and is validated and tested on the same `--eval` validation and `--test`
test examples (the built-in split at seed 42, written once to CSV files): only the training sample changes.

Ways:
  tfidf       character 1-3-gram TF-IDF + logistic regression (scikit-learn), the classical baseline
  today       the fine-tune before prompt-initialised heads: raw text, a zero head, lr 2e-4, 2 epochs
  zero        raw text and a zero head, with the current defaults otherwise (lr, min_steps)
  verbalizer  the head started from the LM head's rows of the label words, texts read inside the prompt
              chosen on the training sample; its runs also score the zero-shot prompt baseline (way
              `baseline`, the prompt chosen on the same training sample, scored on the test examples)
  lm          `objective: lm`, instruction tuning: LoRA trained on the label word after the chosen prompt
              (causal-LM loss), classes scored by the label words' log-probability
  defaults    `loracls train` with nothing set (head_init as the defaults decide)
  no-dropout  the defaults with LoRA's dropout off (`lora_dropout: 0`)
  all-linear-r16  the defaults with LoRA on every linear layer at rank 16, alpha 32

KEY=VALUE pairs change every loracls way's config (e.g. `lr=1e-3`) except what the way itself sets.
Results are written after every point, each with the commit, CPU flags and precision (`auto`'s: bf16 or
`no`, fp32) it ran on; `--resume` keeps the points already in `--out`, `--include` adds those of another
result file that `--out` lacks (a curve gathered over several sittings: the table names every commit its
points came from). Defaults are to be chosen on the
`val` figures, never on `test`. Prints a table of means and spreads (long, then one column per way) and
writes a plot beside the JSON; `--table` only prints and plots what `--out` holds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
from common import CODE, RESULTS, machine, write_result
from lora_vs_tfidf import tfidf_scores

from loracls.config import TrainConfig, parse_overrides
from loracls.data.splits import load_splits, stratified_sample
from loracls.environment.devices import mixed_precision
from loracls.training.train import train

WAYS = {
    "today": {"head_init": "zero", "lr": 2e-4, "epochs": 2.0, "min_steps": 0},
    "zero": {"head_init": "zero"},
    "verbalizer": {"head_init": "verbalizer"},
    "lm": {"objective": "lm"},
    "defaults": {},
    "no-dropout": {"lora_dropout": 0.0},
    "all-linear-r16": {"target_modules": "all-linear", "lora_r": 16, "lora_alpha": 32},
}
"""The loracls ways: config changes on top of TrainConfig's defaults (and the KEY=VALUE overrides)."""

COMMON = {"model": "gemma3-270m", "max_length": 64, "eval_every": 25, "log_every": 25}
"""Settings of every loracls way: the embedded model; texts cut at 64 tokens (as in sweep-data-size.yaml)."""


def write_splits(data: str, eval_n: int, test_n: int, folder: Path) -> tuple[Path, Path, object]:
    """The data set's validation and test files (the built-in split at seed 42, sampled), and its training
    split as a table to sample from."""
    splits = load_splits(TrainConfig(data=data, seed=42))
    val, test = (stratified_sample(t, n, 42) for t, n in ((splits.val, eval_n), (splits.test, test_n)))
    paths = folder / f"{data}-val.jsonl", folder / f"{data}-test.jsonl"
    for table, path in zip((val, test), paths, strict=True):
        write_jsonl(table, path)
    return *paths, splits.train


def write_jsonl(table: pd.DataFrame, path: Path) -> None:
    """JSON lines, not CSV: tweets hold bare carriage returns, which a CSV round trip splits into rows."""
    table[["text", "label"]].to_json(path, orient="records", lines=True, force_ascii=False)


def loracls_point(way: str, train_file: Path, val: Path, test: Path, seed: int, overrides: dict) -> dict:
    settings = {**COMMON, **overrides, **WAYS[way], "baseline": way == "verbalizer"}
    run_dir = Path(tempfile.mkdtemp(prefix=f"lc-{way}-"))
    files = {"data": str(train_file), "val": str(val), "test": str(test)}
    cfg = TrainConfig.load(None, {**files, "seed": seed, "out": str(run_dir), **settings})
    started = time.perf_counter()
    run, metrics = train(cfg)
    wall = time.perf_counter() - started
    pinned = run.read_config()
    point = {
        "val": {k: metrics["best_val"][k] for k in ("accuracy", "macro_f1")},
        "test": {k: metrics["test"][k] for k in ("accuracy", "macro_f1", "pred_distribution")},
        "steps": json.loads((run.path / "train_log.jsonl").read_text().splitlines()[-1])["step"],
        "wall_s": round(wall, 1),
        "head_init": pinned.head_init,
        "objective": pinned.objective,
        "lr": pinned.lr,
        "settings": settings,
    }
    if (run.path / "prompt.json").is_file():
        choice = json.loads((run.path / "prompt.json").read_text())["choice"]
        chosen = next(
            c
            for c in choice["candidates"]
            if c["template"] == choice["chosen"]
            and c["verbalizers"] == ",".join(f"{k}={v}" for k, v in choice["verbalizers"].items())
        )
        point["prompt"] = {
            "chosen": choice["chosen"],
            "verbalizers": choice["verbalizers"],
            "sample": choice["sample"],
            "majority": choice["majority"],
            **{k: chosen[k] for k in ("accuracy", "macro_f1", "kappa")},
        }
    if metrics["baseline"]:
        point["baseline_test"] = {k: metrics["baseline"][k] for k in ("accuracy", "macro_f1")}
    shutil.rmtree(run_dir)
    return point


def point_key(p: dict) -> tuple:
    """What identifies a point: data set, way, training size, seed."""
    return p["data"], p["way"], p["n"], p["seed"]


def summarise(points: list[dict]) -> list[dict]:
    """Mean and spread (min-max) per data set, way and size, of test and val accuracy and macro-F1."""
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault((p["data"], p["way"], p["n"]), []).append(p)
        if "baseline_test" in p:
            # the prompt alone, scored inside the run: a test score, no validation or time of its own
            groups.setdefault((p["data"], "baseline", p["n"]), []).append(
                {"test": p["baseline_test"], **{k: p[k] for k in ("git", "precision") if k in p}}
            )
    rows = []
    for (data, way, n), found in sorted(groups.items()):
        row = {"data": data, "way": way, "n": n, "seeds": len(found)}
        for split in ("val", "test"):
            for key in ("accuracy", "macro_f1"):
                values = [p[split][key] for p in found if split in p]
                if values:
                    row[f"{split}_{key}"] = round(statistics.mean(values), 4)
                    row[f"{split}_{key}_range"] = [round(min(values), 4), round(max(values), 4)]
        row["wall_s"] = round(statistics.mean(p.get("wall_s", 0) for p in found), 1)
        row["commits"] = sorted({p["git"][:7] for p in found if "git" in p})
        row["precisions"] = sorted({p["precision"] for p in found if "precision" in p})
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| data | way | n | seeds | test accuracy (range) | test macro-F1 (range) | val macro-F1 | wall s "
        "| commits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc, f1 = r["test_accuracy_range"], r["test_macro_f1_range"]
        val = f"{r['val_macro_f1']:.3f}" if "val_macro_f1" in r else "-"
        lines.append(
            f"| {r['data']} | {r['way']} | {r['n']} | {r['seeds']} | {r['test_accuracy']:.3f} "
            f"({acc[0]:.3f}-{acc[1]:.3f}) | {r['test_macro_f1']:.3f} ({f1[0]:.3f}-{f1[1]:.3f}) | "
            f"{val} | {r['wall_s']} | {' '.join(r.get('commits', [])) or '-'} |"
        )
    return "\n".join(lines)


def wide_table(rows: list[dict]) -> str:
    """One line per data set and size, one column per way: mean test accuracy / macro-F1, the mean
    validation macro-F1 in brackets, and the number of seeds where there are more than one."""
    order = ("tfidf", "baseline", *WAYS)
    ways = [w for w in order if any(r["way"] == w for r in rows)]
    lines = ["| data | n | " + " | ".join(ways) + " |", "|---|---|" + "---|" * len(ways)]
    cells = {(r["data"], r["n"], r["way"]): r for r in rows}
    for data, n in sorted({(r["data"], r["n"]) for r in rows}, key=lambda k: (k[0], -k[1])):
        line = []
        for way in ways:
            r = cells.get((data, n, way))
            cell = f"{r['test_accuracy']:.3f} / {r['test_macro_f1']:.3f}" if r else ""
            if r and "val_macro_f1" in r:
                cell += f" ({r['val_macro_f1']:.3f})"
            if r and r["seeds"] > 1:
                cell += f" x{r['seeds']}"
            line.append(cell)
        lines.append(f"| {data} | {n} | " + " | ".join(line) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r["data"] for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
    for ax, data in zip(axes[0], datasets, strict=True):
        for way in sorted({r["way"] for r in rows if r["data"] == data}):
            line = sorted((r["n"], r["test_macro_f1"]) for r in rows if r["data"] == data and r["way"] == way)
            ax.plot([n for n, _ in line], [f for _, f in line], marker="o", label=way)
        ax.set(xscale="log", xlabel="training examples", ylabel="test macro-F1", title=data)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="zh-reviews,en-tweets")
    parser.add_argument("--sizes", default="50,100,200,400,800,2000")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seeded-up-to", type=int, default=400)
    parser.add_argument("--ways", default="tfidf,today,zero,verbalizer")
    parser.add_argument("--eval", type=int, default=200, help="validation examples")
    parser.add_argument("--test", type=int, default=400, help="test examples")
    parser.add_argument("--out", type=Path, default=RESULTS / "learning_curve.json")
    parser.add_argument("--resume", action="store_true", help="keep the points already in --out")
    parser.add_argument(
        "--include", type=Path, action="append", default=[], help="add the points of another result file"
    )
    parser.add_argument("--table", action="store_true", help="print --out's tables and plot; run nothing")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="changes to every loracls way")
    args = parser.parse_args()
    overrides = parse_overrides(args.overrides)
    ways = args.ways.split(",")
    unknown = [w for w in ways if w != "tfidf" and w not in WAYS]
    if unknown:
        parser.error(f"unknown ways {unknown}; choose from tfidf, {', '.join(WAYS)}")
    if args.table:
        rows = summarise(json.loads(args.out.read_text())["points"])
        print(table(rows), wide_table(rows), sep="\n\n")
        plot(rows, args.out.with_suffix(".png"))
        return
    points = json.loads(args.out.read_text())["points"] if args.resume and args.out.is_file() else []
    done = {point_key(p) for p in points}
    for other in args.include:
        found = json.loads(other.read_text())
        for p in found["points"]:
            if point_key(p) not in done:
                points.append({"git": found["git"], "src_modified": found["src_modified"], **p})
                done.add(point_key(p))
    # the machine is the file's, and a point may come from another: each says on what CPU and precision
    where = {"cpu_flags": machine()["cpu_flags"], "precision": mixed_precision("auto")}
    folder = Path(tempfile.mkdtemp(prefix="learning-curve-"))
    for data in args.data.split(","):
        val, test, train_split = write_splits(data, args.eval, args.test, folder)
        val_table, test_table = (pd.read_json(p, lines=True, dtype={"label": str}) for p in (val, test))
        for n in (int(x) for x in args.sizes.split(",")):
            for seed in range(args.seeds if n <= args.seeded_up_to else 1):
                sample = stratified_sample(train_split, n, seed)
                train_file = folder / f"{data}-{n}-{seed}.jsonl"
                write_jsonl(sample, train_file)
                for way in ways:
                    if (data, way, n, seed) in done:
                        continue
                    print(f"== {data} n={n} seed={seed} way={way}", flush=True)
                    if way == "tfidf":
                        texts, labels = list(sample["text"]), list(sample["label"])
                        point = {
                            split: tfidf_scores(texts, labels, list(t["text"]), list(t["label"]))
                            for split, t in (("val", val_table), ("test", test_table))
                        }
                    else:
                        point = loracls_point(way, train_file, val, test, seed, overrides)
                    points.append(
                        {
                            "data": data,
                            "way": way,
                            "n": n,
                            "seed": seed,
                            "train_examples": len(sample),
                            "git": CODE[0],
                            "src_modified": CODE[1],
                            **where,
                            **point,
                        }
                    )
                    rows = summarise(points)
                    write_result(
                        args.out,
                        {
                            "question": "test accuracy and macro-F1 of each way by training size (defaults "
                            "chosen on val)",
                            "ways": {w: WAYS.get(w, "TF-IDF + logistic regression") for w in ways},
                            "common": COMMON,
                            "overrides": overrides,
                            "eval_examples": args.eval,
                            "test_examples": args.test,
                            "summary": rows,
                            "points": points,
                        },
                    )
    rows = summarise(points)
    print(table(rows), wide_table(rows), sep="\n\n")
    plot(rows, args.out.with_suffix(".png"))
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
