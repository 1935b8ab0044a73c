"""Re-measure every figure that README.md and benchmarks/README.md quote, on the current commit.

    python benchmarks/reproduce.py                 # all of it: about five hours on 2 CPU cores
    python benchmarks/reproduce.py --only demo,mfu # some of it
    python benchmarks/reproduce.py --quick         # each script once at toy sizes, results to a temp folder
    python benchmarks/reproduce.py --list

Each job is one benchmark script with the arguments its README figure came from; each writes its JSON under
benchmarks/results/ with the commit, whether src/ was modified, the machine (CPU flags, GPU) and the date
(`common.write_result`). Jobs run one after another in child processes; a failed job is reported and the
others still run. `make numbers` runs this.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
DEMO_RUN = "runs/demo-benchmark"

DEMO_EN_RUN = "runs/demo-en-tweets-benchmark"
LC_ZH, LC_EN = "2000,800,400,200,100,50", "800,400,200,100,50"
LC_WAYS = "tfidf,today,verbalizer,lm"
"""The learning curve's sizes, largest first (3 seeds up to 400: `learning_curve.py --seeded-up-to`), and its
ways (the `zero` way, a zero head with the new lr and min_steps, ran at 100 and 400 to choose)."""

JOBS: dict[str, tuple[list[str], list[str]]] = {
    # name: (full arguments, quick arguments); `{out}` is the results folder. Timing-sensitive jobs first.
    "mfu": (
        ["mfu.py", "--steps", "24", "--out", "{out}/mfu.json"],
        ["mfu.py", "--steps", "2", "--out", "{out}/mfu.json"],
    ),
    "frozen_base": (
        ["frozen_base.py", "--out", "{out}/frozen_base_attn-qv.json"],
        [
            "frozen_base.py",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--out",
            "{out}/frozen_base_attn-qv.json",
        ],
    ),
    "frozen_base_train": (
        ["frozen_base.py", "--train", "400", "--out", "{out}/frozen_base_train.json"],
        ["frozen_base.py", "--train", "8", "--rounds", "1", "--out", "{out}/frozen_base_train.json"],
    ),
    "step_anatomy": (
        ["step_anatomy.py", "--out", "{out}/step_anatomy_bf16.json"],
        [
            "step_anatomy.py",
            "--lengths",
            "16",
            "--rows",
            "32",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--profile-length",
            "16",
            "--out",
            "{out}/step_anatomy_bf16.json",
        ],
    ),  # fmt: skip
    "choose_dropout": (
        [
            "learning_curve.py",
            "--data",
            "zh-reviews,en-tweets",
            "--sizes",
            "400",
            "--seeds",
            "3",
            "--ways",
            "defaults,no-dropout",
            "--out",
            "{out}/choose_dropout.json",
            "lora_dropout=0.05",
        ],
        [
            "learning_curve.py",
            "--data",
            "zh-reviews",
            "--sizes",
            "8",
            "--seeds",
            "1",
            "--ways",
            "no-dropout",
            "--eval",
            "8",
            "--test",
            "8",
            "--out",
            "{out}/choose_dropout.json",
            "min_steps=1",
            "baseline=false",
        ],
    ),  # fmt: skip
    "choose_capacity": (
        [
            "learning_curve.py",
            "--data",
            "en-tweets",
            "--sizes",
            "400",
            "--seeds",
            "3",
            "--ways",
            "defaults,all-linear-r16",
            "--out",
            "{out}/choose_capacity_en-tweets.json",
            "target_modules=attn-qv",
        ],
        [
            "learning_curve.py",
            "--data",
            "en-tweets",
            "--sizes",
            "8",
            "--seeds",
            "1",
            "--ways",
            "all-linear-r16",
            "--eval",
            "8",
            "--test",
            "8",
            "--out",
            "{out}/choose_capacity_en-tweets.json",
            "min_steps=1",
            "baseline=false",
        ],
    ),  # fmt: skip
    "cpu_precisions": (
        ["cpu_precisions.py", "--out", "{out}"],
        ["cpu_precisions.py", "--rows", "16", "--texts", "8", "--budget", "0.05", "--out", "{out}"],
    ),
    "prompt_scoring": (
        ["prompt_scoring.py", "--out", "{out}/prompt_scoring.json"],
        ["prompt_scoring.py", "--texts", "8", "--rounds", "1", "--out", "{out}/prompt_scoring.json"],
    ),
    "prompt_rounds": (
        ["prompt_rounds.py", "--out", "{out}/prompt_rounds.json"],
        [
            "prompt_rounds.py",
            "--tasks",
            "en-tweets",
            "--seeds",
            "1",
            "--val",
            "12",
            "--firsts",
            "4",
            "--out",
            "{out}/prompt_rounds.json",
        ],
    ),
    "many_classes": (
        ["many_classes.py", "--out", "{out}/many_classes.json"],
        [
            "many_classes.py",
            "--train",
            "20",
            "min_steps=2",
            "prompt_sample=8",
            "--out",
            "{out}/many_classes.json",
        ],
    ),
    "label_prefix": (
        ["label_prefix.py", "--tasks", "banking77-10", "--val", "20", "--out", "{out}/label_prefix.json"],
        [
            "label_prefix.py",
            "--tasks",
            "banking77-10",
            "--val",
            "4",
            "--sample",
            "20",
            "--out",
            "{out}/label_prefix.json",
        ],
    ),
    "pass_tokens": (
        ["pass_tokens.py", "--texts", "256", "--repeats", "5", "--out", "{out}/pass_tokens.json"],
        ["pass_tokens.py", "--texts", "32", "--repeats", "1", "--out", "{out}/pass_tokens.json"],
    ),
    "serve": (
        ["serve.py", "--texts", "256", "--requests", "96", "--out", "{out}/serve.json"],
        ["serve.py", "--texts", "16", "--requests", "8", "--out", "{out}/serve.json"],
    ),
    "serve_shared": (
        ["serve_shared.py", "--texts", "64", "--requests", "96", "--out", "{out}/serve_shared.json"],
        [
            "serve_shared.py",
            "--texts",
            "8",
            "--requests",
            "8",
            "--rounds",
            "1",
            "--out",
            "{out}/serve_shared.json",
        ],
    ),
    "train_throughput": (
        ["train_throughput.py", "--steps", "24", "--eval", "200", "--out", "{out}/train_throughput.json"],
        [
            "train_throughput.py",
            "--steps",
            "2",
            "--eval",
            "16",
            "--ways",
            "loracls",
            "--out",
            "{out}/tt.json",
        ],
    ),
    "compile_cpu": (
        ["train_throughput.py", "--steps", "12", "--eval", "40", "--ways", "loracls,loracls-compile"]
        + ["--out", "{out}/compile_cpu.json"],
        ["train_throughput.py", "--steps", "2", "--eval", "16", "--ways", "loracls,loracls-compile"]
        + ["--out", "{out}/compile_cpu.json"],
    ),
    "demo": (
        ["demo.py", "--out", "{out}/demo.json", "--run-dir", DEMO_RUN],
        ["demo.py", "--out", "{out}/demo.json", "--run-dir", "{out}/demo-run"]
        + ["max_train_examples=64", "max_eval_examples=32", "eval_every=2"],
    ),
    "inference": (  # after demo: its int8 figures are the demo classifier's
        ["inference.py", "--texts", "500", "--run", DEMO_RUN, "--out", "{out}/inference.json"],
        ["inference.py", "--texts", "16", "--run", "{out}/demo-run", "--out", "{out}/inference.json"],
    ),
    "long_texts": (  # after demo: the demo classifier reads the texts over its 128 tokens each way
        ["long_texts.py", "--run", DEMO_RUN, "--out", "{out}/long_texts.json"],
        ["long_texts.py", "--run", "{out}/demo-run", "--max-texts", "16", "--out", "{out}/long_texts.json"],
    ),
    "demo_en_tweets": (
        ["demo.py", "--out", "{out}/demo_en-tweets.json", "--run-dir", DEMO_EN_RUN, "data=en-tweets"],
        ["demo.py", "--out", "{out}/demo_en.json", "--run-dir", "{out}/demo-en", "data=en-tweets"]
        + ["max_train_examples=64", "max_eval_examples=32", "eval_every=2", "baseline=false"],
    ),
    "audit": (  # data audit against labels flipped on purpose, and three demo runs: noisy, cleaned, clean
        ["audit.py", "--out", "{out}/audit.json"],
        ["audit.py", "--no-train", "--out", "{out}/audit.json"]
        + ["max_train_examples=64", "max_eval_examples=32"],
    ),
    "label_next": (  # loracls select in a simulated labelling loop against random labels
        ["label_next.py", "--out", "{out}/label_next.json"],
        ["label_next.py", "--start", "20", "--step", "10", "--rounds", "1", "--random-up-to", "30"]
        + ["--pool", "100", "--eval", "40", "--test", "40", "--out", "{out}/label_next.json", "min_steps=4"],
    ),
    "prompt_baseline": (
        ["prompt_baseline.py", "--run", f"zh-reviews={DEMO_RUN}", "--run", f"en-tweets={DEMO_EN_RUN}"]
        + ["--out", "{out}/prompt_baseline.json"],
        [
            "prompt_baseline.py",
            "--max-eval-examples",
            "16",
            "--shots",
            "0",
            "--out",
            "{out}/prompt_baseline.json",
        ],
    ),
    "head_rows": (
        ["head_rows.py", "--tasks", "zh-reviews", "en-tweets", "--texts", "500"]
        + ["--out", "{out}/head_rows.json"],
        ["head_rows.py", "--tasks", "en-tweets", "--quick", "--out", "{out}/head_rows.json"],
    ),
    "label_scoring": (
        ["label_scoring.py", "--texts", "32", "--out", "{out}/label_scoring.json"],
        ["label_scoring.py", "--texts", "2", "--out", "{out}/label_scoring.json"],
    ),
    "prompt_pieces": (
        ["prompt_pieces.py", "--out", "{out}/prompt_pieces.json"],
        [
            "prompt_pieces.py",
            "--texts",
            "6",
            "--candidates",
            "2",
            "--banking77-texts",
            "3",
            "--out",
            "{out}/prompt_pieces.json",
        ],
    ),
    "tasks": (
        ["tasks.py", "--out", "{out}/tasks.json"],
        ["tasks.py", "--tasks", "en-tweets,banking77", "--sizes", "en-tweets=48", "--sizes"]
        + ["banking77=2/class", "--seeds", "1", "--eval", "77", "--test", "77", "--out", "{out}/tasks.json"]
        + ["min_steps=2", "prompt_sample=8"],
    ),
    "lora_vs_tfidf": (
        ["lora_vs_tfidf.py", "--eval", "500", "--out", "{out}/lora_vs_tfidf.json"],
        ["lora_vs_tfidf.py", "--train", "64", "--eval", "32", "--out", "{out}/lora_vs_tfidf.json"],
    ),
    "length_grouping": (
        ["train_throughput.py", "--steps", "96", "--eval", "500", "--seed", "0"]
        + [
            "--ways",
            "loracls,loracls-sorted,loracls-random",
            "--out",
            "{out}/length_grouping_zh-reviews_seed0.json",
        ],
        ["train_throughput.py", "--steps", "2", "--eval", "16", "--ways", "loracls,loracls-sorted"]
        + ["--out", "{out}/length_grouping.json"],
    ),
    "learning_curve": (
        ["learning_curve.py", "--data", "zh-reviews", "--sizes", LC_ZH, "--seeds", "3", "--ways", LC_WAYS]
        + ["--out", "{out}/learning_curve.json"],
        ["learning_curve.py", "--data", "zh-reviews", "--sizes", "16", "--seeds", "1", "--eval", "16"]
        + ["--test", "16", "--ways", "tfidf,today,verbalizer", "--out", "{out}/learning_curve.json"]
        + ["min_steps=2", "prompt_sample=8"],
    ),
    "learning_curve_objectives": (
        ["learning_curve.py", "--data", "zh-reviews,en-tweets", "--sizes", "400,100", "--seeds", "1"]
        + ["--ways", "tfidf,today,verbalizer,lm", "--out", "{out}/learning_curve_objectives.json"],
        ["learning_curve.py", "--data", "zh-reviews", "--sizes", "16", "--seeds", "1", "--eval", "16"]
        + ["--test", "16", "--ways", "lm", "--out", "{out}/learning_curve_objectives.json"]
        + ["min_steps=2", "prompt_sample=8"],
    ),
    "learning_curve_en": (
        ["learning_curve.py", "--data", "en-tweets", "--sizes", LC_EN, "--seeds", "3", "--ways", LC_WAYS]
        + ["--resume", "--out", "{out}/learning_curve.json"],
        ["learning_curve.py", "--data", "en-tweets", "--sizes", "16", "--seeds", "1", "--eval", "16"]
        + ["--test", "16", "--ways", "tfidf,verbalizer", "--out", "{out}/learning_curve_en.json"]
        + ["min_steps=2", "prompt_sample=8"],
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(JOBS), help="comma-separated jobs (see --list)")
    parser.add_argument("--quick", action="store_true", help="toy sizes, results into a temporary folder")
    parser.add_argument("--list", action="store_true", help="print the jobs and their commands")
    args = parser.parse_args()
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(names) - set(JOBS))
    if unknown:
        parser.error(f"unknown jobs {unknown}; known: {', '.join(JOBS)}")
    out = Path(tempfile.mkdtemp(prefix="loracls-numbers-")) if args.quick else HERE / "results"
    failed = []
    for name in names:
        arguments = [a.format(out=out) for a in JOBS[name][1 if args.quick else 0]]
        command = [sys.executable, str(HERE / arguments[0]), *arguments[1:]]
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        if args.list:
            continue
        started = time.perf_counter()
        done = subprocess.run(command)
        minutes = (time.perf_counter() - started) / 60
        print(f"== {name}: {'ok' if done.returncode == 0 else 'FAILED'} in {minutes:.1f} min", flush=True)
        if done.returncode != 0:
            failed.append(name)
    if not args.list:
        print(f"results in {out}; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
