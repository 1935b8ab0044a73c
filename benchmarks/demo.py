"""What does `make demo` score and how long does it take? `loracls train --config configs/demo.yaml` as the
README's first command runs it: the prompt baseline on the test reviews, then the fine-tune.

    python benchmarks/demo.py [--out benchmarks/results/demo.json] [--run-dir runs/demo] [KEY=VALUE ...]

Prints the test accuracy beside the baseline's, and the seconds of each stage of the run (metrics.json's
`stages`: the prompt choice and baseline, loading, training, testing, ...), and writes the result (with the
commit, CPU flags, versions).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from common import RESULTS, write_result

from loracls.config import TrainConfig, parse_overrides
from loracls.training.train import train

CONFIG = Path(__file__).parents[1] / "configs/demo.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "demo.json")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo-benchmark"))
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="changes to configs/demo.yaml")
    args = parser.parse_args()
    overrides = parse_overrides(args.overrides)
    if (args.run_dir / "status.json").is_file():  # this benchmark's own earlier run
        shutil.rmtree(args.run_dir)
    cfg = TrainConfig.load(CONFIG, overrides | {"out": str(args.run_dir)})
    started = time.perf_counter()
    run, metrics = train(cfg)
    wall = time.perf_counter() - started
    baseline = metrics["baseline"] or {}
    print(
        f"test accuracy {metrics['test']['accuracy']:.4f} (macro-F1 {metrics['test']['macro_f1']:.4f}); "
        f"baseline {baseline.get('accuracy', float('nan')):.4f}; {wall / 60:.1f} minutes"
    )
    stages = metrics["stages"]
    print("| stage | seconds | share |\n|---|---|---|")
    for name, seconds in stages["seconds"].items():
        print(f"| {name} | {seconds:.1f} | {stages['share'][name]:.1%} |")
    write_result(
        args.out,
        {
            "question": "make demo: test accuracy, the prompt baseline beside it, and its wall time",
            "config": str(CONFIG.relative_to(CONFIG.parents[1])),
            "overrides": overrides,
            "test": {k: metrics["test"][k] for k in ("accuracy", "macro_f1", "pred_distribution", "n")},
            "baseline": baseline,
            "best_val": metrics["best_val"],
            "calibration": {  # the temperature fitted on validation; the test ECE before and after it
                k: v for k, v in (metrics.get("calibration") or {}).items() if not k.startswith("bins")
            },
            "train": metrics["train"],
            "stages": stages,
            "wall_s": round(wall, 1),
            "env_json": json.loads((run.path / "env.json").read_text(encoding="utf-8")).get(
                "mixed_precision"
            ),
        },
    )


if __name__ == "__main__":
    main()
