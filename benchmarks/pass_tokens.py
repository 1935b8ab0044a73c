"""How should a CPU cut a batch of texts into forward passes? Passes of a fixed number of texts (4, 8)
against passes of at most N padded tokens (`length_passes`, `loracls serve --pass-tokens`), on batches of
8 and 16 texts drawn at random (what a server of one-text requests gets) and on all the texts sorted at
once (what `loracls predict` gets).

    python benchmarks/pass_tokens.py [--texts 256] [--repeats 5] [--export FOLDER]

The classifier is the real Gemma 3 270M, trained briefly and exported (`inference.make_export`). Each way
classifies the same 12 random batches (or the one sorted batch); the ways take turns, `--repeats` times,
and the median texts/s of each is reported with its ratio to passes of 8 texts (the server's CPU default
before). Writes benchmarks/results/pass_tokens.json (with the CPU flags).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_result  # noqa: E402
from inference import make_export  # noqa: E402

from loracls.config import TrainConfig  # noqa: E402
from loracls.data.splits import load_splits  # noqa: E402
from loracls.inference.predict import Classifier  # noqa: E402

WAYS = {"4 texts": (4, None), "8 texts": (8, None), "384 tokens": (32, 384), "512 tokens": (32, 512),
        "768 tokens": (32, 768)}  # fmt: skip
"""(texts per pass at most, padded tokens per pass at most)."""
BASELINE = "8 texts"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--export", type=Path, default=None, help="an export (default: train one)")
    parser.add_argument("--out", type=Path, default=RESULTS / "pass_tokens.json")
    args = parser.parse_args()
    export = args.export or make_export("gemma3-270m", "zh-reviews", Path(tempfile.mkdtemp(prefix="passes-")))
    texts = list(load_splits(TrainConfig(data="zh-reviews")).test["text"][: args.texts])
    classifier = Classifier.load(export)
    classifier.predict_probs(texts[:8])  # warm-up
    lengths = [len(ids) for ids in classifier.encode(texts)["input_ids"]]
    rng = np.random.default_rng(0)
    rows = []
    for size in (8, 16, len(texts)):
        batches = (
            [list(rng.choice(texts, size, replace=False)) for _ in range(12)]
            if size < len(texts)
            else [texts]
        )
        speeds: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(args.repeats):
            for way, (pass_size, pass_tokens) in WAYS.items():
                classifier.batch_size, classifier.pass_tokens = pass_size, pass_tokens
                started = time.perf_counter()
                for batch in batches:
                    classifier.predict_probs(batch)
                speeds[way].append(len(batches) * size / (time.perf_counter() - started))
        median = {way: statistics.median(v) for way, v in speeds.items()}
        row = {
            "batch": "all sorted" if size == len(texts) else f"{size} random",
            "texts_per_s": median,
            "spread": {way: [min(v), max(v)] for way, v in speeds.items()},
            "over_baseline": {way: median[way] / median[BASELINE] for way in WAYS},
        }
        rows.append(row)
        cells = " | ".join(f"{median[way]:.1f} ({row['over_baseline'][way]:.2f}x)" for way in WAYS)
        print(f"| {row['batch']} | {cells} |", flush=True)
    write_result(
        args.out,
        {
            "question": "passes of a fixed number of texts or of a token budget, for a CPU's forward passes?",
            "baseline": BASELINE,
            "ways": WAYS,
            "texts": len(texts),
            "token_lengths": {
                "median": float(np.median(lengths)),
                "p90": float(np.percentile(lengths, 90)),
                "max": max(lengths),
            },  # fmt: skip
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
