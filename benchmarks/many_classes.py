"""Does a run on many classes cost what a binary one does? `loracls train` with its defaults on a 2-class
task and on a 10-class one of the same size: each stage's seconds per real token it reads, and the run's
peak resident memory.

Baseline: zh-reviews (2 classes). Candidate: 10 intents of BANKING77 (its 10 most frequent in the
training file; labels that are codes such as `card_arrival`). Both: `--train` examples (stratified, seed
0), 200 validation and 200 test examples, every other setting the default; one `loracls train` process
each, one after the other (peak memory is a process's own). Tokens are the run's own counts: the prompt
search's from its line before it starts, the baseline's the test prompts it reads with the label words'
later tokens, training's the real (unpadded) tokens of `metrics.json`.

    python benchmarks/many_classes.py [--train 300] [--out benchmarks/results/many_classes.json] [KEY=VALUE]

KEY=VALUE pairs change a default for both runs (`min_steps=2` for a smoke test).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml
from common import RESULTS, write_result
from tasks import banking77_splits, builtin_splits

from loracls.config import TrainConfig
from loracls.data.prompts import Prompter, resolve_prompt
from loracls.data.splits import stratified_sample
from loracls.model import load_tokenizer, resolve_model
from loracls.objective import later_tokens

SEARCH = re.compile(r"prompt: scoring .*? \(([\d,]+) prompts, ([\d,]+) tokens")


def task_files(task: str, n: int, folder: Path) -> dict[str, str]:
    """The task's training sample, validation and test examples as files, for `loracls train`."""
    if task == "banking77-10":
        pool, val, test = banking77_splits(770, 3080)
        top = list(pool["label"].value_counts().index[:10])
        pool, val, test = (t[t["label"].isin(top)] for t in (pool, val, test))
        val, test = stratified_sample(val, 200, 42), stratified_sample(test, 200, 42)
    else:
        pool, val, test = builtin_splits(task, 200, 200)
    train = stratified_sample(pool, n, 0)
    files = {}
    for name, table in (("data", train), ("val", val), ("test", test)):
        path = folder / f"{task}-{name}.jsonl"
        table[["text", "label"]].to_json(path, orient="records", lines=True, force_ascii=False)
        files[name] = str(path)
    return files


def baseline_tokens(run: Path, test: str, tokenizer) -> int:
    """The tokens the baseline reads, with the prompt the run chose: each test prompt, and after it the later
    tokens of the label words of several tokens (as the prompt search's count has them); twice where the
    prompt lists the labels (the reversed order is read too)."""
    cfg = TrainConfig.load(run / "config.yaml", written=True)
    table = pd.read_json(test, lines=True)
    labels = sorted(table["label"].astype(str).unique())
    prompter = Prompter(tokenizer, resolve_prompt(labels, [], cfg), [], cfg.max_length)
    words = prompter.label_tokens()
    later = later_tokens([words[label] for label in labels]) * len(table)
    tokens = sum(len(ids) for ids in prompter.encode(list(table["text"]))) + later
    return tokens * (1 + prompter.lists_labels(prompter.prompt.order))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=300)
    parser.add_argument("--tasks", default="zh-reviews,banking77-10", help="the first is the baseline")
    parser.add_argument("--out", type=Path, default=RESULTS / "many_classes.json")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="changes to the defaults")
    args = parser.parse_args()
    changes = [
        f"--{key.replace('_', '-')}={value}" for key, value in (o.split("=", 1) for o in args.overrides)
    ]
    tokenizer = load_tokenizer(resolve_model("gemma3-270m"))
    folder = Path(tempfile.mkdtemp(prefix="many-classes-"))
    rows = []
    for task in args.tasks.split(","):
        files = task_files(task, args.train, folder)
        run = folder / f"run-{task}"
        options = [f"--{key}={value}" for key, value in files.items()]
        command = [sys.executable, "-m", "loracls", "train", *options, *changes, f"--out={run}"]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        if done.returncode:
            sys.exit(f"{task}: loracls train failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        said = " ".join((done.stdout + done.stderr).split())  # the run's lines go to stderr
        metrics = json.loads((run / "metrics.json").read_text(encoding="utf-8"))
        seconds = metrics["stages"]["seconds"]
        pinned = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
        found = SEARCH.search(said)
        if found is None:
            sys.exit(f"{task}: no prompt search line in the run's output:\n{said[-2000:]}")
        search_tokens = int(found.group(2).replace(",", ""))
        base_tokens = baseline_tokens(run, files["test"], tokenizer)
        search_s = seconds["choosing the prompt and scoring the baseline"]
        base_s = (metrics.get("baseline") or {}).get("wall_s", 0.0)
        train = metrics["train"]
        row = {
            "task": task,
            "classes": len(metrics["test"]["per_class"]),
            "train_examples": args.train,
            "target_modules": pinned["target_modules"],
            "lora_r": pinned["lora_r"],
            "head_init": pinned["head_init"],
            "prompt": pinned["prompt"],
            "test_accuracy": metrics["test"]["accuracy"],
            "test_macro_f1": metrics["test"]["macro_f1"],
            "wall_s": round(wall, 1),
            "stages_s": seconds,
            "search_tokens": search_tokens,
            "search_s": round(search_s - base_s, 1),
            "baseline_tokens": base_tokens,
            "baseline_s": round(base_s, 1),
            "train_tokens": round(train["tokens_per_s"] * train["train_s"]),
            "train_s": round(train["train_s"], 1),
            "optimizer_steps": train["optimizer_steps"],
            "padded_per_real_token": train["padded_per_real_token"],
            "peak_rss_gb": train["peak_rss_gb"],
        }
        for stage in ("search", "baseline", "train"):
            tokens = row[f"{stage}_tokens"]
            row[f"{stage}_ms_per_token"] = round(1000 * row[f"{stage}_s"] / tokens, 3) if tokens else None
        rows.append(row)
        print(
            f"{task}: {row['classes']} classes, test macro-F1 {row['test_macro_f1']:.3f}, {wall:.0f} s;"
            f" ms per token: search {row['search_ms_per_token']}, baseline {row['baseline_ms_per_token']},"
            f" training {row['train_ms_per_token']}; peak RSS {row['peak_rss_gb']:.2f} GB",
            flush=True,
        )
    base = rows[0]
    for row in rows[1:]:
        row["vs_baseline"] = {
            stage: round(row[f"{stage}_ms_per_token"] / base[f"{stage}_ms_per_token"], 2)
            for stage in ("search", "baseline", "train")
            if row[f"{stage}_ms_per_token"] and base[f"{stage}_ms_per_token"]
        }
        row["vs_baseline"]["peak_rss"] = round(row["peak_rss_gb"] / base["peak_rss_gb"], 2)
        print(f"{row['task']} against {base['task']}: {row['vs_baseline']}")
    write_result(
        args.out,
        {
            "question": "a 10-class run against a binary one: seconds per real token per stage, peak memory",
            "overrides": args.overrides,
            "baseline": base["task"],
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
