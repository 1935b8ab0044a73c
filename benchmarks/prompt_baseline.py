"""The prompt baseline of the real Gemma 3 270M on the built-in test splits, next to fine-tuned runs.

For each dataset: zero-shot and 4-shot, uncalibrated and calibrated, and with the label order reversed,
with predicted-label distributions and wall time. `--run DATASET=RUN_DIR` adds a finished fine-tuned run
of the same split (same seed, fractions and max_eval_examples) to compare with.

    python benchmarks/prompt_baseline.py --run zh-reviews=runs/demo --run en-tweets=runs/en
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from loracls.config import TrainConfig
from loracls.data import load_splits
from loracls.model import load_tokenizer, resolve_model
from loracls.runs import environment
from loracls.zeroshot import load_causal_lm, run_baseline


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
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()

    path = resolve_model("gemma3-270m")
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path)
    results = []
    for data in args.datasets.split(","):
        cfg = TrainConfig(
            data=data,
            max_eval_examples=args.max_eval_examples,
            max_train_examples=2000,
            max_length=args.max_length,
        )
        splits = load_splits(cfg)
        for shots in map(int, args.shots.split(",")):
            cfg.baseline_shots = shots
            started = time.perf_counter()
            m = run_baseline(model, tokenizer, splits.test, splits.labels, splits.train, cfg)
            row = {
                "data": data,
                "shots": shots,
                "n": len(splits.test),
                "accuracy": m["uncalibrated"]["accuracy"],
                "macro_f1": m["uncalibrated"]["macro_f1"],
                "pred_distribution": m["uncalibrated"]["pred_distribution"],
                "calibrated_accuracy": m["calibrated"]["accuracy"],
                "calibrated_macro_f1": m["calibrated"]["macro_f1"],
                "calibrated_pred_distribution": m["calibrated"]["pred_distribution"],
                "content_free_probs": m["calibrated"]["content_free_probs"],
                "swapped_order_accuracy": m["swapped_order"]["accuracy"],
                "swapped_pred_distribution": m["swapped_order"]["pred_distribution"],
                "gold_distribution": splits.test["label"].value_counts().to_dict(),
                "wall_s": round(time.perf_counter() - started, 1),
                "prompt_example": m["prompt"]["example"],
            }
            results.append(row)
            print(
                json.dumps({k: v for k, v in row.items() if k != "prompt_example"}, ensure_ascii=False),
                flush=True,
            )
    finetuned = finetuned_runs(runs)
    env = environment(torch.device("cpu"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "commit": commit,
                "machine": platform.processor() or platform.machine(),
                "env": env,
                "model": "gemma3-270m",
                "baseline": results,
                "finetuned": finetuned,
            },
            indent=2,
            ensure_ascii=False,
        )
        + "\n"
    )


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
